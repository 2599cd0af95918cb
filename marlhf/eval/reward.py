"""Reward-model scoring of prompt/response pairs, tokenized exactly as step 2 trains on them.

One copy for every tool that scores with a reward model (``rw_eval.py``, ``marlhf rm-eval``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from marlhf.data.formatting import LongPromptPolicy
from marlhf.data.pipeline import SFTCollator, _pad, tokenize_phase
from marlhf.data.records import BadRowPolicy, Record
from marlhf.data.synthetic import gold_scores
from marlhf.dpo import labelled_logprobs
from marlhf.eval.placement import resolve_placement
from marlhf.models.forward import sequence_scores
from marlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer_and_format
from marlhf.tasks import load_task, task_of_datasets
from marlhf.utils.run import RUN_CONTEXT


class Scorer:
    """``scorer(prompts, responses) -> scores`` of a step-2 reward model folder; the end token and prompt
    format come from the folder's record unless given."""

    @staticmethod
    def load(path: str, tokenizer, dtype: torch.dtype = torch.float32):
        return load_reward_model(path, tokenizer, dtype=dtype)

    def __init__(self, path: str, eot: str = "", max_seq_len: int = 1024, prompt_format: str = "auto",
                 device: str = "auto", dtype: str | torch.dtype = "auto"):
        """``device`` / ``dtype``: as the tools' ``--device`` / ``--dtype`` (:mod:`marlhf.eval.placement`)."""

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


def recorded_task(model_dir: str):
    """The task of the run that wrote ``model_dir`` (its args.json, beside it or one level up): the task it
    resolved (its run context), else the task of its recorded --data_path; None when it had none."""

    for folder in (Path(model_dir), Path(model_dir).parent):
        path = folder / "args.json"
        if path.is_file():
            recorded = json.loads(path.read_text())
            if RUN_CONTEXT in recorded:
                name = recorded[RUN_CONTEXT].get("task")
                return load_task(name) if name else None
            return task_of_datasets(recorded.get("data_path") or [])
    return None


def gold_scorer(mode: str, data_path: list[str] | None, reward_model: str):
    """``--gold``: "off" None, "on" the embedded task's gold scorer, "auto" the gold scorer of the task (the task
    declaring ``data_path``'s datasets, else the reward model's run's task) when it has one.  Called as
    ``(prompts, answers[, ended])``."""

    if mode == "off":
        return None
    if mode == "on":
        return gold_scores
    task = task_of_datasets(data_path) if data_path else recorded_task(reward_model)
    return task.gold() if task is not None else None
