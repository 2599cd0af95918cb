"""Rollout: one prompt batch → an :class:`Experience`, everything the PPO update needs (paper Algorithm 1).

    sample answers (:func:`marlhf.sampler.sample`)
    → one forward each of actor, reference and critic on the full sequences        (:func:`forwards`)
    → the sequence score of each answer (the reward source)
    → per-token rewards: −β·(log π − log π_ref), plus the clipped score on the last real answer token
    → termination rule → segment ids                                   (:mod:`marlhf.rlhf.termination`)
    → advantages and returns (macro GAE with the critic, or a critic-free estimator) (:mod:`marlhf.rlhf.advantages`)

``--num_samples_per_prompt K`` samples K answers per prompt; rows i·K … i·K+K−1 answer prompt i (a group).
Advantages are estimated here, over one whole generation batch of one rank, before the update cuts it into
micro-batches, so a group's baseline always sees its K samples.  Without a critic (rloo / grpo / reinforce)
there is no critic forward and ``values`` is None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from marlhf.models.forward import next_token_logits, position_ids_from_mask, token_values
from marlhf.models.logprobs import token_logprobs
from marlhf.rlhf.advantages import AdvantageBatch, AdvantageEstimator
from marlhf.rlhf.estimators import groups
from marlhf.rlhf.ppo_math import token_rewards
from marlhf.rlhf.sections import RolloutSection
from marlhf.sampler import GenerationConfig, Samples, sample
from marlhf.utils.dist import max_over_ranks
from marlhf.utils.timing import NO_TIMER

log = logging.getLogger("marlhf")
_warned_clip = False


@dataclass
class Experience:
    """One generation batch, everything the PPO update needs.  P = prompt width, A = answer width."""

    seq: torch.Tensor  # (B, P+A) prompt (left-padded) + answer (right-padded)
    attention_mask: torch.Tensor  # (B, P+A)
    prompt_width: int  # P
    mask: torch.Tensor  # (B, A) bool, real answer tokens used in the loss (EOS included)
    logprobs: torch.Tensor | None  # (B, A) actor log π_old(a_t | s_t); None: the update's forward gives it
    ref_logprobs: torch.Tensor | None  # (B, A) reference log π_ref; None: nothing reads it (β = 0)
    values: torch.Tensor | None  # (B, A) critic V(s_t); None without a critic (critic-free estimators)
    scores: torch.Tensor  # (B,) sequence score (the reward source's)
    rewards: torch.Tensor  # (B, A) per-token rewards (KL penalty unless --kl_penalty loss + score on the last token)
    seg: torch.Tensor  # (B, A) macro-action segment ids, -1 on padding
    advantages: torch.Tensor  # (B, A) macro advantages (gae) or the response's advantage, broadcast to tokens
    returns: torch.Tensor  # (B, A) macro returns Q (gae) or the sequence return R, broadcast to tokens
    engine_logprobs: torch.Tensor | None = None  # (B, A) the generation engine's log π of the sampled tokens (vLLM)

    def split(self, size: int) -> list[Experience]:
        """Micro-batches of ``size`` samples (the tensors' batch dimension is sliced)."""
        B = self.seq.shape[0]
        out = []
        for i in range(0, B, size):
            kw = {f.name: getattr(self, f.name) for f in fields(self)}
            out.append(Experience(**{k: v[i:i + size] if torch.is_tensor(v) else v for k, v in kw.items()}))
        return out


def answer_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(a_t | s_t) of the answer tokens (B, A) from the logits that predict them (B, A, V): float32
    log_softmax(logits / ``temperature``) at the tokens, computed in chunks so that no float32 copy of the
    logits is kept for backward (:func:`marlhf.models.logprobs.token_logprobs`)."""
    return token_logprobs(logits, tokens, temperature)


def policy_logprobs(model, seq: torch.Tensor, attention_mask: torch.Tensor, P: int,
                    temperature: float = 1.0) -> torch.Tensor:
    """(B, A) log-probs of the answer tokens under ``model``, for a left-padded batch (positions counted from
    each row's first real token); only the columns that predict an answer token are projected.
    ``temperature``: the distribution is softmax(logits / T) (:func:`logprob_temperature`)."""
    logits = next_token_logits(model, seq, attention_mask, P - 1, position_ids=position_ids_from_mask(attention_mask))
    return answer_logprobs(logits, seq[:, P:], temperature)


def critic_values(critic, seq: torch.Tensor, attention_mask: torch.Tensor, P: int) -> torch.Tensor:
    """(B, A) V(s_t) for each answer token t: the critic's head where it has seen the prompt and tokens < t."""
    return token_values(critic, seq, attention_mask)[:, P - 1:-1]


def forwards(actor, ref, critic, s: Samples, timer=NO_TIMER, temperature: float = 1.0, policy: bool = True,
             reference: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One forward each of actor, reference and critic: (log π_old, log π_ref, V), each (B, A); V is None
    without a critic, log π_old without ``policy``, log π_ref without ``reference`` (forwards nothing reads:
    :func:`marlhf.rlhf.sections.needed_forwards`).  ``timer``: :mod:`marlhf.utils.timing` (phases
    ``forward/actor|ref|critic``); ``temperature``: of both policies' distributions (:func:`logprob_temperature`)."""
    P, seq, attn = s.prompt_width, s.seq, s.attention_mask
    logprobs = ref_logprobs = None
    if policy:
        with timer("forward/actor"):
            logprobs = policy_logprobs(actor, seq, attn, P, temperature)
    if reference:
        with timer("forward/ref"):
            ref_logprobs = policy_logprobs(ref, seq, attn, P, temperature)
    if critic is None:
        return logprobs, ref_logprobs, None
    with timer("forward/critic"):
        return logprobs, ref_logprobs, critic_values(critic, seq, attn, P)


def clipped_share(scores: torch.Tensor, clip: float | None) -> float:
    """Share of the scores outside ±``clip`` (their rewards are flattened to the bound); 0 without a clip."""
    return 0.0 if clip is None else (scores.abs() > clip).float().mean().item()


def _warn_if_flattened(share: float, clip: float | None) -> None:
    global _warned_clip
    if share > 0.5 and not _warned_clip:
        _warned_clip = True
        log.warning("%.0f%% of a batch's scores lie outside ±%g (--clip_reward_value): their rewards are all the "
                    "bound, so the reward source barely steers the policy; a reward model with --likelihood_term "
                    "scores far from 0 and needs a wider clip (train/clipped_scores logs the share)", 100 * share, clip)


@dataclass(frozen=True)
class RolloutParts:
    """What a rollout is made of, built once per run (the score closure per batch: it carries the batch meta)."""

    actor: object
    ref: object
    critic: object | None  # None for the estimators without one
    score: Callable  # (samples[, rows]) -> (N,) sequence scores (the reward source); ``rows``: the batch row each
    #                  sample answers (default: row i), for its prompt's meta
    segmenter: object  # marlhf.rlhf.segmentation.MacroSegmenter: answers -> (segment ids, parse fallbacks)
    estimator: AdvantageEstimator  # marlhf.rlhf.advantages
    generation: GenerationConfig
    settings: RolloutSection
    engine: object | None = None  # marlhf.vllm_sampler.VLLMSampler: samples instead of the actor (None: the actor)

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cfg: GenerationConfig,
               num_samples: int) -> Samples:
        """Answers from π_old: the generation engine's when the run has one, else the actor's own ``generate``."""
        if self.engine is not None:
            return self.engine.sample(prompt_ids, prompt_mask, cfg, num_samples=num_samples)
        return sample(self.actor, prompt_ids, prompt_mask, cfg, num_samples=num_samples,
                      zero3_generation=self.settings.zero3_generation)


def pack_samples(rows: list[tuple[list[int], list[int], bool]], P: int, A: int, pad_id: int,
                 device) -> Samples:
    """Samples from (prompt ids, answer ids, ended) rows: prompts left-padded to width ``P``, answers right-padded
    to ``A`` (each answer's real tokens are all of its ids)."""
    N = len(rows)
    seq = torch.full((N, P + A), pad_id, dtype=torch.long)
    attn = torch.zeros((N, P + A), dtype=torch.long)
    for i, (prompt, answer, _) in enumerate(rows):
        seq[i, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        attn[i, P - len(prompt):P] = 1
        seq[i, P:P + len(answer)] = torch.tensor(answer, dtype=torch.long)
        attn[i, P:P + len(answer)] = 1
    ended = torch.tensor([e for _, _, e in rows], dtype=torch.bool)
    seq, attn = seq.to(device), attn.to(device)
    return Samples(seq, attn, P, attn[:, P:].bool(), ended.to(device))


@torch.no_grad()
def monte_carlo_values(actor, score: Callable, out: Samples, seg: torch.Tensor, K: int,
                       generation: GenerationConfig, clip_reward_value: float | None, zero3_generation: str = "gather",
                       chunk: int = 64, engine=None) -> tuple[torch.Tensor, int]:
    """V̂(s_k) of every macro action's start state (VinePPO / SPO): from s_k = prompt + the answer's tokens before
    macro action k, K continuations sampled with the current policy, the answer's token budget kept (a
    continuation is cut at A − t tokens, and then did not end); V̂(s_k) = the mean of their clipped scores.
    ``score(samples, rows)``: the reward source on samples whose row i continues answer ``rows[i]``.  Returns
    ((B, M) float32, 0 past a sample's last action; the number of continuations sampled).

    The states are generated ``chunk`` at a time, longest prefix first, each chunk with the largest budget among
    its states (A − its shortest prefix): late boundaries need few tokens, and a chunk that mixed them with
    early ones would generate the whole answer budget for every row.

    Each chunk's generation and scoring are collective under ZeRO-3 (the parameters gathered, or fetched per
    layer), and ranks have different numbers of boundaries: every rank runs as many chunks as the rank with
    the most, a rank out of states generating and scoring a one-state stand-in whose result it drops.  ``engine``:
    a generation engine (vLLM) that samples the continuations instead of the actor."""
    P, A = out.prompt_width, out.seq.shape[1] - out.prompt_width
    B, M = seg.shape[0], int(seg.max().item()) + 1 if seg.numel() and bool((seg >= 0).any()) else 0
    values = torch.zeros((B, M), dtype=torch.float32, device=seg.device)
    states = [(b, k, int((seg[b] == k).nonzero()[0, 0])) for b in range(B) for k in range(int(seg[b].max()) + 1)
              if bool((seg[b] >= 0).any())]
    states.sort(key=lambda state: -state[2])  # stable: equal prefixes keep the (answer, action) order
    chunks = max_over_ranks(math.ceil(len(states) / chunk))
    for lo in range(0, chunks * chunk, chunk):
        part = states[lo:lo + chunk] or [(0, -1, 0)]  # the stand-in: answer 0 from its start, result dropped
        cfg = dataclasses.replace(generation, max_new_tokens=max(A - part[-1][2], 1))
        prompts = [out.seq[b, :P][out.attention_mask[b, :P].bool()].tolist() for b, _, _ in part]
        prefixes = [out.seq[b, P:P + t].tolist() for b, _, t in part]
        width = max(len(p) + len(x) for p, x in zip(prompts, prefixes))
        ids = torch.full((len(part), width), generation.pad_id, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, (p, x) in enumerate(zip(prompts, prefixes)):
            ids[i, width - len(p) - len(x):] = torch.tensor(p + x, dtype=torch.long)
            mask[i, width - len(p) - len(x):] = 1
        ids, mask = ids.to(out.seq.device), mask.to(out.seq.device)
        cont = engine.sample(ids, mask, cfg, num_samples=K) if engine is not None else \
            sample(actor, ids, mask, cfg, num_samples=K, zero3_generation=zero3_generation)
        rows, owners = [], []
        for i, (b, _, t) in enumerate(part):
            for j in range(K):
                r = i * K + j
                n = int(cont.answer_mask[r].sum())
                keep = min(n, A - t)
                rows.append((prompts[i], prefixes[i] + cont.answers[r, :keep].tolist(),
                             bool(cont.ended[r]) and n <= A - t))
                owners.append(b)
        scores = score(pack_samples(rows, P, A, generation.pad_id, out.seq.device), owners).float()
        if clip_reward_value is not None:
            scores = scores.clamp(-clip_reward_value, clip_reward_value)
        means = scores.reshape(len(part), K).mean(dim=1)
        for i, (b, k, _) in enumerate(part):
            if k >= 0:
                values[b, k] = means[i]
    return values, len(states) * K


def critic_mc_agreement(values: torch.Tensor, mc_values: torch.Tensor, seg: torch.Tensor) -> dict[str, float]:
    """How well the critic's V(s_k) — its value at the first token of macro action k, the state before it —
    agrees with the Monte-Carlo V̂(s_k) (VinePPO's diagnostic): Pearson correlation and root-mean-square gap over
    every macro boundary of the batch."""
    M = mc_values.shape[1]
    first = torch.zeros_like(mc_values, dtype=torch.bool)
    critic = torch.zeros_like(mc_values)
    for b in range(seg.shape[0]):
        for k in range(int(seg[b].max()) + 1 if bool((seg[b] >= 0).any()) else 0):
            t = int((seg[b] == k).nonzero()[0, 0])
            first[b, k], critic[b, k] = True, values[b, t].float()
    x, y = critic[first[:, :M]].double(), mc_values[first[:, :M]].double()
    if x.numel() < 2:
        return {}
    xc, yc = x - x.mean(), y - y.mean()
    denom = (xc.square().sum() * yc.square().sum()).sqrt()
    corr = float((xc * yc).sum() / denom) if denom > 0 else float("nan")
    return {"critic_mc_corr": corr, "critic_mc_rmse": float((x - y).square().mean().sqrt())}


class RolloutRecord:
    """A rollout's statistics, kept beside the algorithm: ``with record.clock(phase, stat)`` times a phase for
    the cost benchmark's ``timer`` (:mod:`marlhf.utils.timing`) and adds its wall-clock seconds to ``stat``;
    the steps put what they report in :attr:`stats`."""

    def __init__(self, timer=NO_TIMER):
        self.timer = timer
        self.stats: dict[str, float] = {}

    @contextlib.contextmanager
    def clock(self, phase: str, stat: str):
        t0 = time.time()
        with self.timer(phase):
            yield
        self.stats[stat] = self.stats.get(stat, 0.0) + time.time() - t0


@dataclass(frozen=True)
class RolloutContext:
    """One batch's rollout as the steps after generation see it: its parts, its samples, its record.  An
    estimator asks it for what it needs beyond the forwards
    (:meth:`marlhf.rlhf.advantages.AdvantageEstimator.prepare`: Monte-Carlo values), so does the critic's check."""

    parts: RolloutParts
    samples: Samples
    record: RolloutRecord

    def monte_carlo_values(self, seg: torch.Tensor, K: int) -> torch.Tensor:
        """(B, M) V̂(s_k) of every macro action's start state from K continuations each
        (:func:`monte_carlo_values`, timed as ``generation/mc``); logs mc_continuations and mc_seconds."""
        p, s = self.parts, self.parts.settings
        with self.record.clock("generation/mc", "mc_seconds"):
            values, n = monte_carlo_values(p.actor, p.score, self.samples, seg, K, p.generation, s.clip_reward_value,
                                           s.zero3_generation, engine=p.engine)
        self.record.stats["mc_continuations"] = float(n)
        return values


def generate(parts: RolloutParts, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             record: RolloutRecord) -> Samples:
    """K = ``--num_samples_per_prompt`` answers to each prompt sampled from π_old; rows i·K … i·K+K−1 answer
    prompt i, and this batch holds whole groups only (one rank generated them).  Timed as ``gen_seconds``."""
    K = parts.settings.num_samples_per_prompt
    with record.clock("generation", "gen_seconds"):
        out = parts.sample(prompt_ids, prompt_mask, parts.generation, K)
    if out.seq.shape[0] != prompt_ids.shape[0] * K:  # pragma: no cover - sample() guarantees it
        raise AssertionError(f"{out.seq.shape[0]} samples for {prompt_ids.shape[0]} prompts x K={K}")
    groups(torch.arange(out.seq.shape[0]), K)
    return out


def trainable(out: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss mask (B, A), valid (B,)): empty and one-token answers (under two tokens before the stop token) are
    masked out of the loss (and counted, ``invalid_answers``)."""
    valid = out.answer_mask.sum(dim=1) - out.ended.long() >= 2
    return out.answer_mask & valid[:, None], valid


def score(rollout: RolloutContext) -> torch.Tensor:
    """(B,) each answer's sequence score from the reward source (timed as ``forward/reward``)."""
    with rollout.record.timer("forward/reward"):
        return rollout.parts.score(rollout.samples)


def segment(rollout: RolloutContext, mask: torch.Tensor, logprobs: torch.Tensor | None,
            ref_logprobs: torch.Tensor | None, step: int, batch: int) -> torch.Tensor:
    """(B, A) the termination rule's macro actions (paper §3.2.1) as segment ids, -1 on padding; a parser's
    fallbacks are counted (``parse_fallbacks``).  Timed as ``macro`` (``macro_seconds``)."""
    with rollout.record.clock("macro", "macro_seconds"):
        seg, fallbacks = rollout.parts.segmenter(rollout.samples.answers, mask, ref_logprobs, step, batch,
                                                 logprobs=logprobs)
    rollout.record.stats["parse_fallbacks"] = float(fallbacks)
    return seg


def rewarded_batch(settings: RolloutSection, mask: torch.Tensor, valid: torch.Tensor, seg: torch.Tensor,
                   logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, values: torch.Tensor | None,
                   scores: torch.Tensor) -> AdvantageBatch:
    """What the estimator reads, with the per-token rewards −β(log π_old − log π_ref) (β when the KL is in the
    reward, :func:`marlhf.rlhf.sections.kl_in_reward`) plus the clipped score on the last real token
    (:func:`marlhf.rlhf.ppo_math.token_rewards`).  A skipped forward is read only with a zero weight (the
    KL's β = 0): zeros stand in, changing no number."""
    lp = logprobs if logprobs is not None else torch.zeros(mask.shape, device=mask.device)
    ref_lp = ref_logprobs if ref_logprobs is not None else lp
    rewards = token_rewards(lp, ref_lp, mask, scores, settings.policy.reward_kl_ctl, settings.clip_reward_value)
    return AdvantageBatch(mask, valid, seg, lp, ref_lp, values, rewards, scores)


def estimate(rollout: RolloutContext, batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The estimator's (B, A) advantages and returns and its statistics; it first asks the rollout for what it
    needs beyond the forwards (:meth:`~marlhf.rlhf.advantages.AdvantageEstimator.prepare`: mc_macro's
    Monte-Carlo values).  The estimate is timed as ``macro`` (``macro_seconds``)."""
    estimator = rollout.parts.estimator
    batch = estimator.prepare(batch, rollout)
    with rollout.record.clock("macro", "macro_seconds"):
        return estimator(batch)


def check_critic(rollout: RolloutContext, batch: AdvantageBatch) -> None:
    """``--critic_mc_check K`` with a critic (any estimator's): its V(s_k) against Monte-Carlo V̂(s_k) from K
    continuations of every macro boundary (:func:`critic_mc_agreement`; train/critic_mc_corr, critic_mc_rmse)."""
    K = rollout.parts.settings.critic_mc_check
    if batch.values is None or K <= 0:
        return
    mc_values = rollout.monte_carlo_values(batch.seg, K)
    rollout.record.stats.update(critic_mc_agreement(batch.values, mc_values, batch.seg))


def experience_stats(exp: Experience, out: Samples, valid: torch.Tensor, record: RolloutRecord,
                     estimator_stats: dict, clip: float | None) -> dict[str, float]:
    """The rollout's statistics (logged as train/*): the scores (all, the valid answers', the share clipped),
    the return, the answers' length, end and validity, the record's (timings, parse fallbacks, Monte-Carlo
    continuations, the critic's check), the estimator's, and the KL to the reference when both forwards ran."""
    scores, valid_n, r = exp.scores, valid.sum().clamp(min=1), record.stats
    clipped = clipped_share(scores, clip)
    _warn_if_flattened(clipped, clip)
    stats = {"reward": scores.mean().item(),
             "clipped_scores": clipped,
             "reward_valid": (scores * valid).sum().item() / valid_n.item(),
             "return": exp.returns[:, 0].mean().item() if exp.returns.shape[1] else 0.0,
             "response_len": out.answer_mask.sum(dim=1).float().mean().item(),
             "eos_rate": out.ended.float().mean().item(),
             "invalid_answers": float((~valid).sum().item()),
             **{k: r[k] for k in ("parse_fallbacks", "gen_seconds", "macro_seconds", "mc_continuations",
                                  "mc_seconds", "critic_mc_corr", "critic_mc_rmse") if k in r},
             **{k: float(v) for k, v in estimator_stats.items()}}
    if exp.engine_logprobs is not None and exp.logprobs is not None:  # the engine's numbers against the actor's
        gap = torch.where(exp.mask, (exp.logprobs - exp.engine_logprobs).abs(), 0.0)
        stats["engine_logprob_gap_mean"] = (gap.sum() / exp.mask.sum().clamp(min=1)).item()
        stats["engine_logprob_gap_max"] = gap.max().item() if gap.numel() else 0.0
    if exp.logprobs is not None and exp.ref_logprobs is not None:  # the KL to the reference, when both were computed
        kl = torch.where(exp.mask, exp.logprobs - exp.ref_logprobs, 0.0).sum(dim=1)
        stats["kl"] = (kl.sum() / valid_n).item()
    return stats


@torch.no_grad()
def make_experience(parts: RolloutParts, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, step: int,
                    batch: int = 0, timer=NO_TIMER) -> tuple[Experience, dict]:
    """Paper Algorithm 1, lines 3-8, on one prompt batch (``batch``: its index in the step): sample answers,
    run the forwards, score the answers, segment them into macro actions, shape the rewards, estimate the
    advantages — one call each; the statistics and timings are kept beside them (:class:`RolloutRecord`,
    :func:`experience_stats`).  ``timer`` (:mod:`marlhf.utils.timing`) times the phases ``generation``,
    ``forward/*``, ``macro`` (segmentation + advantages) and ``generation/mc`` for the cost benchmark."""
    s, record = parts.settings, RolloutRecord(timer)
    out = generate(parts, prompt_ids, prompt_mask, record)  # y ~ π_old(·|x), K answers per prompt
    rollout = RolloutContext(parts, out, record)
    logprobs, ref_logprobs, values = forwards(parts.actor, parts.ref, parts.critic, out, timer,  # log π_old, log π_ref,
                                              s.policy.logprob_temperature, s.policy_forward,  # V(s_t)
                                              s.reference_forward)
    scores = score(rollout)  # the reward source's sequence scores
    mask, valid = trainable(out)  # answers long enough to train on
    seg = segment(rollout, mask, logprobs, ref_logprobs, step, batch)  # termination rule -> macro actions
    data = rewarded_batch(s, mask, valid, seg, logprobs, ref_logprobs, values, scores)  # r_t = -β KL_t (+ score)
    advantages, returns, estimator_stats = estimate(rollout, data)  # macro advantages and returns
    check_critic(rollout, data)  # --critic_mc_check: the critic against Monte-Carlo values
    exp = Experience(out.seq, out.attention_mask, out.prompt_width, mask, logprobs, ref_logprobs, values, scores,
                     data.rewards, seg, advantages, returns, out.engine_logprobs)
    return exp, experience_stats(exp, out, valid, record, estimator_stats, s.clip_reward_value)
