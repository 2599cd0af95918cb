"""Task-specific pieces step 3 plugs in: a gold scorer where the task has one, and ptx data."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from marlhf.data.records import BadRowPolicy, DataError, require_text
from marlhf.errors import ConfigError

log = logging.getLogger("marlhf")


class GoldScorer:
    """Reward source ``gold``: the embedded task's gold scorer (:mod:`marlhf.rewards`).

    :meth:`score` reads each post's facts from ``meta["facts"]`` (written by the synthetic generator and
    carried through the data cache), and parses the prompt text only for data without them; ``ended`` says
    which answers stopped at an end token.  ``details`` returns every component as well (printed next to the
    total); calling the scorer, ``(prompts, answers, ended) -> scores``, parses the prompts."""

    def __init__(self):
        from marlhf.data import synthetic

        self._synthetic = synthetic
        self.components = synthetic.GOLD_COMPONENTS

    def __call__(self, prompts, answers, ended=None) -> list[float]:
        return self._synthetic.gold_scores(prompts, answers, ended)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        return [d["total"] for d in self.details(prompts, responses, ended, meta)]

    def details(self, prompts, answers, ended=None, meta=None) -> list[dict[str, float]]:
        return self._synthetic.gold_score_details(prompts, answers, ended, self._facts(meta, len(prompts)))

    def _facts(self, meta, n: int):
        if meta is None:
            return None
        if len(meta) != n:
            raise ValueError(f"gold scorer: {n} prompts but {len(meta)} meta entries")
        facts = self._synthetic.PostFacts.from_meta
        return [facts(m["facts"]) if m and "facts" in m else None for m in meta]


def gold_scorer_for(data_path: list[str]):
    """The embedded task's :class:`GoldScorer` when every dataset is synthetic, else None."""
    if data_path and all(spec.split(":", 1)[0] == "synthetic" for spec in data_path):
        return GoldScorer()
    return None


def ptx_items(args, tokenizer) -> list[dict] | None:
    """Tokenized examples of ``--unsupervised_dataset_name`` for the ptx loss.

    Plain text (a local .txt file, or a json/jsonl/parquet file whose rows have a ``text`` field and no
    ``prompt``) is pre-training data as in DeepSpeed-Chat: documents joined with the end-of-conversation
    token, cut into blocks of max_prompt_seq_len + max_answer_seq_len tokens, loss on every token.  Any
    other dataset gives prompt + chosen examples with the loss on the response, as in step 1."""
    if not args.unsupervised_dataset_name or args.unsup_coef == 0:
        return None
    from marlhf.data.adapters import load_records
    from marlhf.data.formatting import LongPromptPolicy
    from marlhf.data.pipeline import tokenize_phase

    policy = BadRowPolicy(args.bad_rows)
    block = args.max_prompt_seq_len + args.max_answer_seq_len
    docs = plain_text_documents(args.unsupervised_dataset_name, policy)
    if docs is not None:
        items = text_blocks(docs, tokenizer, block, args.end_of_conversation_token)
        log.info("ptx plain text %s: %d documents, %d blocks of <= %d tokens; %s", args.unsupervised_dataset_name,
                 len(docs), len(items), block, policy.summary())
        if not items:
            raise ConfigError(f"{args.unsupervised_dataset_name}: no text for the ptx loss")
        return items
    records = load_records(args.unsupervised_dataset_name, split="train", bad_rows=policy)
    # the ptx batches are right-padded like SFT batches, independent of the prompt tokenizer's side
    items = tokenize_phase(records, 1, tokenizer, eot=args.end_of_conversation_token,
                           max_seq_len=args.max_prompt_seq_len + args.max_answer_seq_len,
                           max_prompt_len=args.max_prompt_seq_len, policy=policy, prompt_format=args.prompt_format,
                           long_prompts=LongPromptPolicy(args.long_prompts))
    log.info("ptx data %s: %d examples; %s", args.unsupervised_dataset_name, len(items), policy.summary())
    return items


def plain_text_documents(spec: str, policy: BadRowPolicy) -> list[str] | None:
    """The documents of a plain-text dataset, or None when ``spec`` is not one.

    A .txt file holds documents separated by blank lines (a UTF-8 byte-order mark is ignored); a json/jsonl/
    parquet file is plain text when its first row has ``text`` and no ``prompt``."""
    from marlhf.data.adapters.files import iter_file_rows, row_extension

    path = Path(spec).expanduser()
    if spec.endswith(".txt"):
        if not path.is_file():
            raise ConfigError(f"--unsupervised_dataset_name {spec}: no such file")
        text = path.read_text(encoding="utf-8-sig")
        return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    if not (path.is_file() and row_extension(path.name)):
        return None
    rows = iter_file_rows(path)
    first = next(rows, None)
    if first is None or isinstance(first[2], DataError) or not isinstance(first[2], dict) \
            or "text" not in first[2] or "prompt" in first[2]:
        return None
    docs = []
    for file, n, row in [first, *rows]:
        try:
            if isinstance(row, DataError):
                raise row
            docs.append(require_text(row, "text", file, n))
        except DataError as err:
            policy.handle(err)
    return docs


def text_blocks(docs: list[str], tokenizer, block: int, eot: str) -> list[dict]:
    """Documents → token blocks of ``block`` (the last one shorter), each document ended by ``eot``; every
    token is a label (``response_start`` 0)."""
    end = tokenizer.convert_tokens_to_ids(eot) if eot else None
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
    blocks = [ids[i:i + block] for i in range(0, len(ids), block)]
    return [{"input_ids": b, "response_start": 0} for b in blocks if len(b) >= 2]
