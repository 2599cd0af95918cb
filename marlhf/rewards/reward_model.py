"""Reward source ``reward_model``: a step-2 reward model scores prompt + response, tokenized exactly as step 2
trains on them — in step 3 the frozen reward engine reads the sampled token sequences as they are
(:class:`RewardModelSource`, or several combined conservatively, :class:`RewardEnsembleSource`); the tools
(``marlhf score-pairs``, ``marlhf score-policies``) load a reward model folder and score text (:class:`Scorer`;
:class:`LikelihoodScorer` ranks by an LM's likelihood instead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from marlhf.data.formatting import LongPromptPolicy
from marlhf.data.pipeline import SFTCollator, _pad, tokenize_phase
from marlhf.data.records import BadRowPolicy, Record
from marlhf.dpo import labelled_logprobs
from marlhf.models.forward import sequence_scores
from marlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer_and_format
from marlhf.models.placement import resolve_placement
from marlhf.sections import DataSection, SupervisedSection


class Scorer:
    """``scorer(prompts, responses) -> scores`` of a step-2 reward model folder; the end token and prompt
    format come from the folder's record unless given."""

    @staticmethod
    def load(path: str, tokenizer, dtype: torch.dtype = torch.float32):
        return load_reward_model(path, tokenizer, dtype=dtype)

    def __init__(self, path: str, eot: str = "", max_seq_len: int = SupervisedSection.max_seq_len,
                 prompt_format: str = DataSection.prompt_format,
                 device: str = "auto", dtype: str | torch.dtype = "auto"):
        """``device`` / ``dtype``: as the tools' ``--device`` / ``--dtype`` (:mod:`marlhf.models.placement`)."""

        self.placement = resolve_placement(device, dtype)
        self.tok, self.format = load_tokenizer_and_format(path, eot, prompt_format)
        self.model = self.load(path, self.tok, self.placement.dtype).to(self.placement.device).eval()
        self.eot, self.max_len = self.format.end_of_conversation_token, max_seq_len

    def __call__(self, prompts: list[str], responses: list[str], batch_size: int = 16) -> list[float]:
        """Scores of prompt + response + end token, tokenized as step 2 tokenizes them (prompt format, length
        limit, long prompts truncated from the left)."""
        return score_texts(self.model, self.tok, prompts, responses, eot=self.eot,
                           prompt_format=self.format.prompt_format, max_seq_len=self.max_len, batch_size=batch_size)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        """The reward-source interface (:mod:`marlhf.rewards`); ``meta`` and ``ended`` are not used."""
        return self(prompts, responses)


class LikelihoodScorer(Scorer):
    """``scorer(prompts, responses) -> scores``: each response's summed log-probability (end token included)
    under a causal LM, tokenized as step 2 tokenizes a pair.  A reference ranker for reward models: an SFT
    model imitates the chosen answers, so how likely it finds an answer says much about the answer's quality
    (and it reads every token, where a reward model's score head reads the last one)."""

    @staticmethod
    def load(path: str, tokenizer, dtype: torch.dtype = torch.float32):
        return load_causal_lm(path, tokenizer, dtype=dtype)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], batch_size: int = 16) -> list[float]:

        items = _items(self.tok, prompts, responses, eot=self.eot, prompt_format=self.format.prompt_format,
                       max_seq_len=self.max_len)
        collate, device, out = SFTCollator(self.tok.pad_token_id), next(iter(self.model.parameters())).device, []
        for i in range(0, len(items), batch_size):
            batch = {k: v.to(device) for k, v in collate(items[i:i + batch_size]).items()}
            out += labelled_logprobs(self.model, batch).tolist()
        return out


def _items(tokenizer, prompts: list[str], responses: list[str], *, eot: str, prompt_format: str,
           max_seq_len: int) -> list[dict]:
    records = [Record(p, r, None, f"<input>:{i}") for i, (p, r) in enumerate(zip(prompts, responses), 1)]
    return tokenize_phase(records, 1, tokenizer, eot=eot, max_seq_len=max_seq_len, max_prompt_len=0,
                          policy=BadRowPolicy(), prompt_format=prompt_format,
                          long_prompts=LongPromptPolicy("truncate"))


@torch.no_grad()
def score_texts(model, tokenizer, prompts: list[str], responses: list[str], *, eot: str, prompt_format: str,
                max_seq_len: int, batch_size: int = 16) -> list[float]:
    """Reward-model scores of prompt + response + end token, tokenized as step 2 tokenizes them."""
    items = _items(tokenizer, prompts, responses, eot=eot, prompt_format=prompt_format, max_seq_len=max_seq_len)
    device = next(iter(model.parameters())).device
    out = []
    for i in range(0, len(items), batch_size):
        batch = items[i:i + batch_size]
        ids, mask = _pad([x["input_ids"] for x in batch], tokenizer.pad_token_id)
        start = torch.tensor([x["response_start"] for x in batch], device=device)
        out += sequence_scores(model, ids.to(device), mask.to(device), start).tolist()
    return out


class RewardModelSource:
    """Reward source ``reward_model``: a value model's head at the last real token of prompt + response.

    ``model``: a Hugging Face value model or a (frozen) DeepSpeed engine around one.  For text callers,
    ``tokenizer`` and the step-2 format say how to tokenize: its end token, its resolved prompt format ("raw" or
    "chat_template": :func:`marlhf.models.loading.load_tokenizer_and_format` reads them from a model folder) and
    its length limit."""

    def __init__(self, model, tokenizer=None, *, eot: str = "", prompt_format: str | None = None,
                 max_seq_len: int | None = None, batch_size: int = 16):
        if tokenizer is not None and (prompt_format is None or max_seq_len is None):
            raise ValueError("a reward model that scores text needs the step-2 format it was trained in: "
                             "prompt_format and max_seq_len")
        self.model, self.tokenizer = model, tokenizer
        self.eot, self.prompt_format, self.max_seq_len, self.batch_size = eot, prompt_format, max_seq_len, batch_size

    @torch.no_grad()
    def score_sequences(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        """(B,) scores of already-tokenized sequences: left-padded prompts ``prompt_width`` wide, then answers."""

        return sequence_scores(self.model, seq, attention_mask, prompt_width)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        """Scores of prompt + response + end token, tokenized as step 2 tokenizes them."""
        if self.tokenizer is None:
            raise ValueError("this reward model source scores token sequences only (built without a tokenizer)")

        return score_texts(self.model, self.tokenizer, prompts, responses, eot=self.eot,
                           prompt_format=self.prompt_format, max_seq_len=self.max_seq_len,
                           batch_size=self.batch_size)


ENSEMBLE_REDUCTIONS = ("mean_minus_std", "mean", "min")


def ensemble_reward(scores: torch.Tensor, reduce: str = "mean_minus_std", std_coef: float = 1.0) -> torch.Tensor:
    """(B,) reward of an ensemble from its members' (M, B) scores (Coste et al. 2023, "Reward model ensembles
    help mitigate overoptimization"): ``mean``; ``min`` (worst case); ``mean_minus_std``: the mean less
    ``std_coef`` times the members' standard deviation (over the M members, population form: one member has
    std 0), so an answer the members disagree on — where a proxy is least to be trusted — scores lower."""
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"ensemble scores must be (members, batch), got shape {tuple(scores.shape)}")
    if reduce == "mean":
        return scores.mean(0)
    if reduce == "min":
        return scores.min(0).values
    if reduce == "mean_minus_std":
        return scores.mean(0) - std_coef * scores.std(0, correction=0)
    raise ValueError(f"unknown ensemble reduction {reduce!r}; choose from {', '.join(ENSEMBLE_REDUCTIONS)}")


class RewardEnsembleSource:
    """Reward source ``reward_model`` with ``--reward_ensemble``: several reward models score each answer and
    :func:`ensemble_reward` combines their scores.  ``members``: :class:`RewardModelSource` objects (the main
    reward model first)."""

    def __init__(self, members: Sequence[RewardModelSource], reduce: str = "mean_minus_std", std_coef: float = 1.0):
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 reward models, got {len(members)}")
        self.members, self.reduce, self.std_coef = list(members), reduce, std_coef

    @torch.no_grad()
    def score_sequences(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        scores = torch.stack([m.score_sequences(seq, attention_mask, prompt_width).float() for m in self.members])
        return ensemble_reward(scores, self.reduce, self.std_coef)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        scores = torch.tensor([m.score(prompts, responses, meta, ended=ended) for m in self.members],
                              dtype=torch.float32)
        return ensemble_reward(scores, self.reduce, self.std_coef).tolist()
