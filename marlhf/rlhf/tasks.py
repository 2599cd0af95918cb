"""Task-specific pieces step 3 plugs in: a gold scorer where the task has one, and ptx data."""

from __future__ import annotations

import logging

from marlhf.data.records import BadRowPolicy

log = logging.getLogger("marlhf")


class GoldScorer:
    """The embedded task's gold scorer: ``(prompts, answers, ended) -> scores``; ``ended`` says which answers
    stopped at an end token.  ``details`` returns every component as well (printed next to the total)."""

    def __init__(self):
        from marlhf.data import synthetic

        self._synthetic = synthetic
        self.components = synthetic.GOLD_COMPONENTS

    def __call__(self, prompts, answers, ended=None) -> list[float]:
        return self._synthetic.gold_scores(prompts, answers, ended)

    def details(self, prompts, answers, ended=None) -> list[dict[str, float]]:
        return self._synthetic.gold_score_details(prompts, answers, ended)


def gold_scorer_for(data_path: list[str]):
    """The embedded task's :class:`GoldScorer` when every dataset is synthetic, else None."""
    if data_path and all(spec.split(":", 1)[0] == "synthetic" for spec in data_path):
        return GoldScorer()
    return None


def ptx_items(args, tokenizer) -> list[dict] | None:
    """Tokenized examples of ``--unsupervised_dataset_name`` for the ptx loss (prompt + chosen, all rows)."""
    if not args.unsupervised_dataset_name or args.unsup_coef == 0:
        return None
    from marlhf.data.adapters import load_records
    from marlhf.data.pipeline import tokenize_phase

    policy = BadRowPolicy(args.bad_rows)
    records = load_records(args.unsupervised_dataset_name, split="train", bad_rows=policy)
    # the ptx batches are right-padded like SFT batches, independent of the prompt tokenizer's side
    items = tokenize_phase(records, 1, tokenizer, eot=args.end_of_conversation_token,
                           max_seq_len=args.max_prompt_seq_len + args.max_answer_seq_len,
                           max_prompt_len=args.max_prompt_seq_len, policy=policy)
    log.info("ptx data %s: %d examples; %s", args.unsupervised_dataset_name, len(items), policy.summary())
    return items
