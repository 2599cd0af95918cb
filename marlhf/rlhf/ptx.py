"""The ptx (pre-training) data of step 3: ``--unsupervised_dataset_name`` as token blocks or SFT examples."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from marlhf.data.adapters import load_records
from marlhf.data.adapters.files import iter_file_rows, row_extension
from marlhf.data.formatting import LongPromptPolicy
from marlhf.data.pipeline import tokenize_phase
from marlhf.data.records import BadRowPolicy, DataError, require_text
from marlhf.errors import ConfigError

if TYPE_CHECKING:
    from marlhf.sections import DataSection

log = logging.getLogger("marlhf")


def ptx_items(dataset: str, tokenizer, data: DataSection, max_answer_seq_len: int) -> list[dict] | None:
    """Tokenized examples of ``dataset`` (``--unsupervised_dataset_name``; empty: None) for the ptx loss, under the
    run's step-3 data rules (``data``: bad rows, long prompts, the prompt limit, the end token and format).

    Plain text (a local .txt file, or a json/jsonl/parquet file whose rows have a ``text`` field and no
    ``prompt``) is pre-training data as in DeepSpeed-Chat: documents joined with the end-of-conversation
    token, cut into blocks of max_prompt_seq_len + max_answer_seq_len tokens, loss on every token.  Any
    other dataset gives prompt + chosen examples with the loss on the response, as in step 1."""
    if not dataset:
        return None

    policy = BadRowPolicy(data.bad_rows)
    block = data.max_prompt_seq_len + max_answer_seq_len
    docs = plain_text_documents(dataset, policy)
    if docs is not None:
        items = text_blocks(docs, tokenizer, block, data.end_of_conversation_token)
        log.info("ptx plain text %s: %d documents, %d blocks of <= %d tokens; %s", dataset, len(docs), len(items),
                 block, policy.summary())
        if not items:
            raise ConfigError(f"{dataset}: no text for the ptx loss")
        return items
    records = load_records(dataset, split="train", bad_rows=policy)
    # the ptx batches are right-padded like SFT batches, independent of the prompt tokenizer's side
    items = tokenize_phase(records, 1, tokenizer, eot=data.end_of_conversation_token, max_seq_len=block,
                           max_prompt_len=data.max_prompt_seq_len, policy=policy, prompt_format=data.prompt_format,
                           long_prompts=LongPromptPolicy(data.long_prompts))
    log.info("ptx data %s: %d examples; %s", dataset, len(items), policy.summary())
    return items


def plain_text_documents(spec: str, policy: BadRowPolicy) -> list[str] | None:
    """The documents of a plain-text dataset, or None when ``spec`` is not one.

    A .txt file holds documents separated by blank lines (a UTF-8 byte-order mark is ignored); a json/jsonl/
    parquet file is plain text when its first row has ``text`` and no ``prompt``."""

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
