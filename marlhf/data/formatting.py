"""How a record becomes the text a policy reads: the prompt format and the end-of-answer token.

Both are properties of the model folder, not of a command line:

* ``prompt_format``: ``raw`` is DeepSpeed-Chat's text as the adapters write it ("\\n\\nHuman: … \\n\\nAssistant:",
  "… TL;DR:"), the default for base models; ``chat_template`` renders the record as chat messages with the
  tokenizer's own template, which instruct models were trained on.  It is the default for an instruct
  model, recognised by its EOS being the token that ends the template's assistant turn (SmolLM2-Instruct,
  Llama-3.x-Instruct, Qwen2.5-Instruct); base models that ship a template anyway (Gemma, Qwen2.5,
  Llama-3.2 base) end their text with another token and stay ``raw``.
* ``end_of_conversation_token``: appended to every response in steps 1-2 and where generation stops in
  step 3.  Default: the token that ends an assistant turn of the chat template (``<|im_end|>``,
  ``<|eot_id|>``, ``<end_of_turn>``), else DeepSpeed-Chat's ``<|endoftext|>`` when the tokenizer has it as a
  token of its own, else the tokenizer's EOS.  A token that is the unknown token or that encodes to several
  ids is an error naming it.

Every step writes both to :data:`FORMAT_FILE` in its output folder; the next step, ``rw_eval.py`` and
inference tools read them back from the model folder (:func:`read_format`), so a user never repeats them.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("marlhf")

FORMAT_FILE = "conversation_format.json"
PROMPT_FORMATS = ("raw", "chat_template")
DEEPSPEED_CHAT_EOT = "<|endoftext|>"
LONG_PROMPTS = ("truncate", "skip", "error")

# the dialogue markers of the HH-style prompts the adapters write (marlhf.data.adapters.rows)
_TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass(frozen=True)
class ConversationFormat:
    end_of_conversation_token: str
    prompt_format: str  # "raw" | "chat_template"

    def to_dict(self) -> dict:
        return asdict(self)


def read_format(model_dir: str | Path) -> dict:
    """The recorded format of a model folder ({} when it has none, e.g. a model not trained here)."""
    path = Path(model_dir) / FORMAT_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with end_of_conversation_token and prompt_format")
    return data


def write_format(folder: str | Path, fmt: ConversationFormat) -> None:
    (Path(folder) / FORMAT_FILE).write_text(json.dumps(fmt.to_dict(), indent=1) + "\n")


def check_same_format(fmt: ConversationFormat, *model_dirs: str) -> None:
    """Step 3: a reward model / critic trained with another end token or prompt format would score the
    policy's answers at the wrong place or in a format it never saw: an error naming both."""
    for folder in filter(None, model_dirs):
        recorded = read_format(folder)
        for key, value in fmt.to_dict().items():
            if recorded.get(key) not in (None, value):
                raise ValueError(f"{folder} was trained with {key} {recorded[key]!r} ({FORMAT_FILE}), the actor "
                                 f"uses {value!r}: train both with the same one")


# --------------------------------------------------------------------------------------------------------
# the end-of-answer token
# --------------------------------------------------------------------------------------------------------
def chat_end_token(tokenizer) -> str | None:
    """The special token that closes an assistant turn in the tokenizer's chat template (None without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "MARLHF_PROBE_ANSWER"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception as err:  # a template that rejects this conversation: fall back to EOS, say so
        log.warning("could not render the chat template to find its end-of-turn token (%s)", err)
        return None
    tail = text[text.rfind(marker) + len(marker):]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for i in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if i in special:
            return tokenizer.convert_ids_to_tokens(i)
    return None


def default_end_token(tokenizer, prompt_format: str) -> str:
    """The end-of-answer token a model folder implies (see the module docstring)."""
    if prompt_format == "chat_template":
        token = chat_end_token(tokenizer)
        if token:
            return token
    if DEEPSPEED_CHAT_EOT in tokenizer.get_vocab() and \
            tokenizer.convert_tokens_to_ids(DEEPSPEED_CHAT_EOT) != tokenizer.unk_token_id:
        return DEEPSPEED_CHAT_EOT
    if tokenizer.eos_token:
        return tokenizer.eos_token
    raise ValueError(f"{tokenizer.name_or_path}: the tokenizer has no EOS token; give --end_of_conversation_token")


def end_token_id(tokenizer, token: str) -> int:
    """The single id of ``token``; a clear error when it is the unknown token or encodes to several ids."""
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    where = f"--end_of_conversation_token {token!r}"
    hint = (f"; leave the flag out to use the model's own end token, or pass --add_eot_token to register "
            f"{token!r} as a new special token")
    if len(ids) != 1:
        raise ValueError(f"{where} is not a token of {tokenizer.name_or_path}: it encodes to {len(ids)} ids "
                         f"{ids}{hint}")
    if tokenizer.unk_token_id is not None and ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"{where} is the unknown token (id {ids[0]}) of {tokenizer.name_or_path}, so it cannot "
                         f"mark the end of an answer{hint}")
    return ids[0]


def resolve_format(tokenizer, recorded: dict, end_token_flag: str, prompt_format_flag: str) -> ConversationFormat:
    """Flag > the model folder's record > the tokenizer's own defaults; logs where each value came from."""
    instruct = tokenizer.eos_token is not None and chat_end_token(tokenizer) == tokenizer.eos_token
    fmt = prompt_format_flag if prompt_format_flag != "auto" else recorded.get("prompt_format") or \
        ("chat_template" if instruct else "raw")
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {fmt!r}")
    if fmt == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--prompt_format chat_template: {tokenizer.name_or_path} has no chat template")
    eot = end_token_flag or recorded.get("end_of_conversation_token") or default_end_token(tokenizer, fmt)
    for key, value in (("prompt_format", fmt), ("end_of_conversation_token", eot)):
        if recorded.get(key) not in (None, value):
            log.warning("%s %r differs from the %r the model was trained with (%s)", key, value, recorded[key],
                        FORMAT_FILE)
    end_token_id(tokenizer, eot)
    log.info("prompt format %s, end-of-answer token %r (%s)", fmt, eot,
             "from the command line" if end_token_flag else "recorded with the model" if
             recorded.get("end_of_conversation_token") else "the tokenizer's own")
    return ConversationFormat(eot, fmt)


# --------------------------------------------------------------------------------------------------------
# records -> chat messages -> text
# --------------------------------------------------------------------------------------------------------
def prompt_messages(prompt: str) -> list[dict]:
    """Chat messages of a record's prompt: HH-style dialogues ("\\n\\nHuman: …\\n\\nAssistant: …\\n\\nAssistant:",
    as HH-RLHF / Dahoas / WebGPT records are written) become alternating user / assistant turns, the final
    empty "Assistant:" being the generation prompt; any other prompt (TL;DR, APPS) is one user message."""
    parts = _TURN.split(prompt)
    if len(parts) < 3 or parts[0].strip():
        return [{"role": "user", "content": prompt.strip()}]
    messages = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
                for who, text in zip(parts[1::2], parts[2::2])]
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


class PromptFormatter:
    """Prompt text and token ids in one prompt format.

    ``raw``: ids of ``prompt`` and of ``prompt + response + eot`` as the tokenizer encodes text (BOS
    included).  ``chat_template``: the prompt is the template's rendering of the messages with the
    assistant header (``add_generation_prompt``), the response its stripped text followed by the end token —
    exactly the template's assistant turn — encoded without adding special tokens a second time."""

    def __init__(self, tokenizer, prompt_format: str = "raw", eot: str = ""):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        self.tokenizer, self.format, self.eot = tokenizer, prompt_format, eot

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompt_text(self, prompt: str) -> str:
        return prompt if self.format == "raw" else self.render(prompt_messages(prompt))

    def response_text(self, response: str) -> str:
        return (response if self.format == "raw" else response.strip()) + self.eot

    def encode(self, text: str) -> list[int]:
        if self.format == "raw":
            return self.tokenizer(text)["input_ids"]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_candidates(self, prompt: str) -> list[str]:
        """The prompt, then shorter versions that keep the most recent turns (cut where a user turn
        starts), longest first: what left-truncation at a turn boundary may choose from."""
        if self.format == "raw":
            starts = [m.start() for m in re.finditer(r"\n\nHuman:", prompt)]
            return [prompt] + [prompt[s:] for s in starts if s > 0]
        messages = prompt_messages(prompt)
        out = [self.render(messages)]
        out += [self.render(messages[k:]) for k in range(1, len(messages)) if messages[k]["role"] == "user"]
        return out


    def cut_inside(self, prompt: str, limit: int) -> tuple[str, int]:
        """(text, leading tokens to drop) keeping the end of the most recent turn within ``limit`` tokens.

        raw: the last turn's first tokens are dropped.  chat_template: the last user message loses the start
        of its text (the smallest cut that fits, by bisection), so the template's markup stays intact."""
        last = self.prompt_candidates(prompt)[-1]
        if self.format == "raw":
            return last, max(0, len(self.encode(last)) - limit)
        message = prompt_messages(prompt)[-1]
        text = message["content"]
        render = lambda start: self.render([{**message, "content": text[start:]}])  # noqa: E731
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.encode(render(mid))) <= limit:
                hi = mid
            else:
                lo = mid + 1
        kept = render(lo)
        return kept, max(0, len(self.encode(kept)) - limit)  # the markup alone may exceed a tiny limit


class LongPromptPolicy:
    """``--long_prompts``: a prompt over its token limit is ``truncate``d from the left (the most recent
    turns stay; cut at a turn boundary when one fits, else inside the first kept turn), ``skip``ped, or an
    ``error``.  Counts what it did, for one summary line per outcome."""

    def __init__(self, mode: str = "truncate"):
        if mode not in LONG_PROMPTS:
            raise ValueError(f"long_prompts must be one of {LONG_PROMPTS}, got {mode!r}")
        self.mode = mode
        self.counts: Counter[str] = Counter()
        self.longest = 0

    def fit(self, formatter: PromptFormatter, prompt: str, limit: int) -> tuple[str, int] | None:
        """(formatted prompt text, leading tokens to drop) so the prompt has at most ``limit`` tokens, or
        None when it is skipped.  The drop count is > 0 only when no turn boundary fits: then the most recent
        turn's text is kept and its first tokens are cut."""
        candidates = formatter.prompt_candidates(prompt)
        n = len(formatter.encode(candidates[0]))
        if n <= limit:
            return candidates[0], 0
        self.longest = max(self.longest, n)
        if self.mode == "skip":
            self.counts["skipped"] += 1
            return None
        if self.mode == "error":
            raise ValueError(f"{n} tokens, longer than the limit {limit} (--long_prompts truncate keeps the most "
                             f"recent turns, --long_prompts skip drops such prompts)")
        for text in candidates[1:]:
            n = len(formatter.encode(text))
            if n <= limit:
                self.counts["truncated at a turn boundary"] += 1
                return text, 0
        self.counts["truncated inside a turn"] += 1
        return formatter.cut_inside(prompt, limit)

    def summary(self, limit_name: str) -> str:
        if not self.counts:
            return f"no prompt over {limit_name}"
        parts = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        return f"prompts over {limit_name} (longest {self.longest} tokens): {parts}"
