"""Rollout: one prompt batch → an :class:`Experience`, everything the PPO update needs (paper Algorithm 1).

    sample answers (:func:`marlhf.generation.sample`)
    → one forward each of actor, reference and critic on the full sequences        (:func:`forwards`)
    → the sequence score of each answer (the reward source)
    → per-token rewards: −β·(log π − log π_ref), plus the clipped score on the last real answer token
    → termination rule → segment ids → macro advantages and returns                (:func:`macro_advantages`)

``--num_samples_per_prompt K`` samples K answers per prompt; rows i·K … i·K+K−1 answer prompt i (a group).
Advantages are estimated here, over one whole generation batch of one rank, before the update cuts it into
micro-batches, so a group's baseline always sees its K samples. ``--advantage_estimator gae`` is macro GAE
with the critic (:func:`macro_advantages`); rloo / grpo / reinforce are the critic-free estimators of
:mod:`marlhf.rlhf.estimators` (no critic forward, ``values`` is None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from marlhf.generation import GenerationConfig, Samples, sample
from marlhf.models.forward import next_token_logits, position_ids_from_mask, token_values
from marlhf.models.logprobs import token_logprobs
from marlhf.rlhf.estimators import critic_free_advantages, groups
from marlhf.rlhf.macro import num_macros
from marlhf.rlhf.ppo_math import compute_advantages, token_rewards, whiten
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
    logprobs: torch.Tensor  # (B, A) actor log π_old(a_t | s_t)
    ref_logprobs: torch.Tensor  # (B, A) reference log π_ref
    values: torch.Tensor | None  # (B, A) critic V(s_t); None without a critic (critic-free estimators)
    scores: torch.Tensor  # (B,) sequence score (the reward source's)
    rewards: torch.Tensor  # (B, A) per-token rewards (KL penalty unless --kl_penalty loss + score on the last token)
    seg: torch.Tensor  # (B, A) macro-action segment ids, -1 on padding
    advantages: torch.Tensor  # (B, A) macro advantages (gae) or the response's advantage, broadcast to tokens
    returns: torch.Tensor  # (B, A) macro returns Q (gae) or the sequence return R, broadcast to tokens

    def split(self, size: int) -> list[Experience]:
        """Micro-batches of ``size`` samples (the tensors' batch dimension is sliced)."""
        B = self.seq.shape[0]
        out = []
        for i in range(0, B, size):
            kw = {f.name: getattr(self, f.name) for f in fields(self)}
            out.append(Experience(**{k: v[i:i + size] if torch.is_tensor(v) else v for k, v in kw.items()}))
        return out


@dataclass(frozen=True)
class RolloutSettings:
    """The step-3 flags a rollout reads (reward shaping, advantage estimate, ZeRO-3 generation)."""

    kl_ctl: float
    clip_reward_value: float | None
    value_function: str = "equal"
    macro_reward: str = "sum"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = False
    zero3_generation: str = "gather"
    advantage_estimator: str = "gae"
    num_samples_per_prompt: int = 1  # K
    kl_penalty: str = "reward"
    grpo_normalization: str = "std"
    logprob_temperature: float = 1.0  # T of π = softmax(logits / T) for π_old and π_ref (logprob_temperature)

    @classmethod
    def from_args(cls, args) -> RolloutSettings:
        return cls(kl_ctl=args.kl_ctl, clip_reward_value=args.clip_reward_value,
                   value_function=args.value_function, macro_reward=args.macro_reward, gamma=args.gamma,
                   lam=args.lam, whiten_advantages=args.whiten_advantages, zero3_generation=args.zero3_generation,
                   advantage_estimator=args.advantage_estimator, num_samples_per_prompt=args.num_samples_per_prompt,
                   kl_penalty=args.kl_penalty, grpo_normalization=args.grpo_normalization,
                   logprob_temperature=logprob_temperature(args))

    @property
    def reward_kl_ctl(self) -> float:
        """β of the per-token KL penalty in the reward: 0 when the KL is a loss term instead."""
        return self.kl_ctl if self.kl_penalty == "reward" else 0.0


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


def logprob_temperature(args) -> float:
    """T of the policy distribution π = softmax(logits / T) that π_old, π, π_ref and the KL are computed from
    (``--logprob_temperature``): 1 (raw logits: DeepSpeed-Chat and the MA-RLHF code, the default) or
    ``sampling``: the sampling ``--temperature`` (TRL and OpenRLHF), so that π_old is the temperature-scaled
    distribution the answers were drawn from (top-k / top-p truncation is not applied: a token outside the
    truncated set would get log π = -inf)."""
    choice = str(getattr(args, "logprob_temperature", "1"))
    if choice == "sampling":
        return float(args.temperature)
    if choice in ("1", "1.0"):
        return 1.0
    raise ValueError(f"--logprob_temperature must be '1' or 'sampling', got {choice!r}")


def critic_values(critic, seq: torch.Tensor, attention_mask: torch.Tensor, P: int) -> torch.Tensor:
    """(B, A) V(s_t) for each answer token t: the critic's head where it has seen the prompt and tokens < t."""
    return token_values(critic, seq, attention_mask)[:, P - 1:-1]


def forwards(actor, ref, critic, s: Samples, timer=NO_TIMER,
             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward each of actor, reference and critic: (log π_old, log π_ref, V), each (B, A); V is None
    without a critic.  ``timer``: :mod:`marlhf.utils.timing` (phases ``forward/actor|ref|critic``);
    ``temperature``: of both policies' distributions (:func:`logprob_temperature`)."""
    P, seq, attn = s.prompt_width, s.seq, s.attention_mask
    with timer("forward/actor"):
        logprobs = policy_logprobs(actor, seq, attn, P, temperature)
    with timer("forward/ref"):
        ref_logprobs = policy_logprobs(ref, seq, attn, P, temperature)
    if critic is None:
        return logprobs, ref_logprobs, None
    with timer("forward/critic"):
        return logprobs, ref_logprobs, critic_values(critic, seq, attn, P)


def macro_advantages(segmenter, answer: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor,
                     values: torch.Tensor, rewards: torch.Tensor, settings: RolloutSettings, step: int,
                     batch: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, int]:
    """Termination rule → segment ids → macro GAE (paper §3.2.2): (seg, advantages, returns, statistics,
    parse fallbacks), token tensors (B, A)."""
    seg, fallbacks = segmenter(answer, mask, ref_logprobs, step, batch)
    advantages, returns, stats = compute_advantages(values, rewards, mask, seg, settings.value_function,
                                                    settings.macro_reward, settings.gamma, settings.lam,
                                                    settings.whiten_advantages)
    return seg, advantages, returns, stats, fallbacks


def sequence_advantages(segmenter, answer: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
                        logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
                        settings: RolloutSettings, step: int,
                        batch: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, int]:
    """The critic-free estimators (rloo / grpo / reinforce, :mod:`marlhf.rlhf.estimators`): the response is
    one action with one advantage on all its tokens; the segments only serve ``--policy_ratio macro``
    (the ratio and its clipping per macro action). Same outputs as :func:`macro_advantages`."""
    seg, fallbacks = segmenter(answer, mask, ref_logprobs, step, batch)
    advantages, R, stats = critic_free_advantages(
        settings.advantage_estimator, scores, logprobs, ref_logprobs, mask, group_size=settings.num_samples_per_prompt,
        kl_ctl=settings.kl_ctl, clip_reward_value=settings.clip_reward_value, kl_penalty=settings.kl_penalty,
        grpo_normalization=settings.grpo_normalization, valid=valid)
    if settings.whiten_advantages:  # check_estimator_options rejects it with grpo (already normalised)
        advantages = whiten(advantages, mask)
    n_macro = num_macros(seg).double()  # (B,)
    stats["num_macros"] = n_macro.sum() / max(seg.shape[0], 1)
    stats["macro_len"] = mask.sum().double() / n_macro.sum().clamp(min=1)
    return seg, advantages, torch.where(mask, R[:, None], 0.0), stats, fallbacks


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


@torch.no_grad()
def make_experience(actor, ref, critic, score: Callable[[Samples], torch.Tensor], segmenter,
                    gen_cfg: GenerationConfig, settings: RolloutSettings, prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor, step: int, batch: int = 0,
                    timer=NO_TIMER) -> tuple[Experience, dict]:
    """Generate, score and segment answers to one prompt batch (``batch``: its index in the step).

    ``score``: the samples → (B·K,) sequence scores (the reward source).  Empty and one-token answers are
    masked out of the loss and counted (``invalid_answers``).  ``critic`` is None for the critic-free
    estimators.  ``timer`` (:mod:`marlhf.utils.timing`) times the phases ``generation``, ``forward/*`` and
    ``macro`` (segmentation + advantages) for the cost benchmark."""
    K = settings.num_samples_per_prompt
    t0 = time.time()
    with timer("generation"):
        out = sample(actor, prompt_ids, prompt_mask, gen_cfg, num_samples=K,
                     zero3_generation=settings.zero3_generation)
    gen_time = time.time() - t0
    if out.seq.shape[0] != prompt_ids.shape[0] * K:  # pragma: no cover - sample() guarantees it
        raise AssertionError(f"{out.seq.shape[0]} samples for {prompt_ids.shape[0]} prompts x K={K}")
    groups(torch.arange(out.seq.shape[0]), K)  # this batch holds whole groups only (one rank generated them)
    mask, ended, answer = out.answer_mask, out.ended, out.answers
    length = mask.sum(dim=1)
    content = length - ended.long()  # tokens before the stop token
    valid = content >= 2  # empty and one-token answers are masked out of the loss (and counted)

    logprobs, ref_logprobs, values = forwards(actor, ref, critic, out, timer, settings.logprob_temperature)
    with timer("forward/reward"):
        scores = score(out)

    loss_mask = mask & valid[:, None]
    rewards = token_rewards(logprobs, ref_logprobs, loss_mask, scores, settings.reward_kl_ctl,
                            settings.clip_reward_value)
    t1 = time.time()
    with timer("macro"):
        if settings.advantage_estimator == "gae":
            seg, advantages, returns, mstats, fallbacks = macro_advantages(
                segmenter, answer, loss_mask, ref_logprobs, values, rewards, settings, step, batch)
        else:
            seg, advantages, returns, mstats, fallbacks = sequence_advantages(
                segmenter, answer, loss_mask, valid, logprobs, ref_logprobs, scores, settings, step, batch)
    macro_time = time.time() - t1
    exp = Experience(out.seq, out.attention_mask, out.prompt_width, loss_mask, logprobs, ref_logprobs, values,
                     scores, rewards, seg, advantages, returns)
    kl = torch.where(loss_mask, logprobs - ref_logprobs, 0.0).sum(dim=1)
    n_valid = valid.sum().clamp(min=1)
    clipped = clipped_share(scores, settings.clip_reward_value)
    _warn_if_flattened(clipped, settings.clip_reward_value)
    stats = {"reward": scores.mean().item(),
             "clipped_scores": clipped,
             "reward_valid": (scores * valid).sum().item() / n_valid.item(),
             "kl": (kl.sum() / n_valid).item(),
             "return": returns[:, 0].mean().item() if returns.shape[1] else 0.0,
             "response_len": length.float().mean().item(),
             "eos_rate": ended.float().mean().item(),
             "invalid_answers": float((~valid).sum().item()),
             "parse_fallbacks": float(fallbacks),
             "gen_seconds": gen_time, "macro_seconds": macro_time,
             **{k: float(v) for k, v in mstats.items()}}
    return exp, stats
