"""Sampling answers to many prompts into a JSON-lines file that a stopped run can resume.

The tools of ``inference/`` (``generate``, ``chat``, ``best_of_n``) load a policy the same way
(:class:`LoadedPolicy`: any HF folder, a step's output — step 3's ``actor/`` picked automatically — or the
embedded default) and sample through the one generation seam, :func:`marlhf.sampler.sample`.

Resumability (:func:`generate_file`): prompts are cut into fixed batches; batch ``b`` is sampled under its
own seed (``batch_seed(seed, b)``), so what it produces does not depend on the batches before it or on the
process that runs it.  Each batch's rows are written with one ``write`` followed by ``fsync``.  On restart
the file is read back, a torn last line and the rows of an incomplete batch are cut off, and sampling goes on
at the first missing batch: the finished file is byte-identical to the one an uninterrupted run writes.
The settings the rows were sampled with are kept beside the file (``<output>.settings.json``), and a resume
with other settings is refused rather than silently mixing two distributions in one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.formatting import LongPromptPolicy, PromptFormatter
from marlhf.data.pipeline import _pad, phase_records
from marlhf.data.records import BadRowPolicy, DataError, require_text
from marlhf.embedded import default_model
from marlhf.errors import ConfigError
from marlhf.models.card import STEP3_MODELS, locate
from marlhf.models.loading import load_causal_lm, load_tokenizer_and_format, resolve_model_path, stop_token_ids
from marlhf.models.placement import add_placement_args, resolve_placement
from marlhf.sampler import GenerationConfig, decode_samples, sample
from marlhf.sections import (
    DataSection,
    GenerationEngineSection,
    RobustnessSection,
    SamplingSection,
    ScheduleSection,
)
from marlhf.utils import events
from marlhf.utils.flags import Section, add_flags, derived, flag

log = logging.getLogger("marlhf")

SETTINGS_SUFFIX = ".settings.json"


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the raw prompt as the dataset writes it (the policy's prompt format is applied at encoding)


def prompts_from_file(path: str | Path) -> list[Prompt]:
    """Prompts of a json/jsonl/parquet file: a ``prompt`` per row, ``id`` (or ``prompt_id``) optional (default:
    the row number).  A bad row is a DataError naming file, row and field."""

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist")
    out, seen = [], {}
    for file, n, row in iter_file_rows(path):
        if isinstance(row, DataError):
            raise row
        text = require_text(row, "prompt", file, n)
        pid = row.get("id", row.get("prompt_id", n))
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise DataError(file, n, "id", f"expected text or an integer, got {type(pid).__name__}")
        pid = str(pid)
        if pid in seen:
            raise DataError(file, n, "id", f"{pid!r} repeats row {seen[pid]}")
        seen[pid] = n
        out.append(Prompt(pid, text))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


def prompts_from_dataset(specs: Sequence[str], split: str, *, data_split: str, seed: int, eval_fraction: float,
                         bad_rows: str = "error", phase: int = 3) -> list[Prompt]:
    """The prompts training sees: ``split`` "eval" is the held-out set step ``phase`` evaluates on (the test
    split, or the seeded held-out slice), "train" is that step's share of the training rows — the same
    rows as training under the same ``--data_split`` / ``--seed`` / ``--eval_fraction``."""

    if split not in ("train", "eval"):
        raise ConfigError(f"--split must be 'train' or 'eval', got {split!r}")
    policy = BadRowPolicy(bad_rows)
    train, evaluation = phase_records(list(specs), data_split, phase, seed, eval_fraction, policy)
    if policy.num_skipped:
        log.info("%s", policy.summary())
    records = train if split == "train" else evaluation
    if not records:
        raise ConfigError(f"{', '.join(specs)}: no {split} prompts for step {phase}")
    return [Prompt(f"{split}-{i}", r.prompt) for i, r in enumerate(records)]


def policy_folder(path: str, model: str = "actor") -> str:
    """The model folder to sample from: ``path`` itself (an HF folder or hub name), step 3's ``model``
    sub-folder when ``path`` is a step-3 output, or the embedded default when empty."""

    if not path or not Path(path).expanduser().is_dir():
        return resolve_model_path(default_model(path))

    src = locate(path, model)
    if src.adapter_only:
        raise ConfigError(f"{src.model_dir}: a LoRA adapter without merged weights; merge it first with "
                          f"marlhf export --input {src.model_dir} --output_dir MERGED")
    return str(src.model_dir)


class LoadedPolicy:
    """A causal LM with its tokenizer (left padding), conversation format and stop ids, in eval mode."""

    def __init__(self, path: str, model: str = "actor", eot: str = "", prompt_format: str = DataSection.prompt_format,
                 device: str = "auto", dtype: str | torch.dtype = "auto",
                 engine: GenerationEngineSection | None = None):
        """``device`` / ``dtype``: as the tools' ``--device`` / ``--dtype`` (:mod:`marlhf.models.placement`);
        ``engine``: the tools' ``--generation_backend`` flags (vllm: a vLLM engine on the policy's folder samples)."""

        self.placement = resolve_placement(device, dtype)
        if engine is not None:  # the engine's flags, before any model loads
            try:
                engine.check(on_gpu=self.placement.device.type == "cuda")
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if engine.backend == "vllm":
                from marlhf.vllm_sampler import require_vllm

                require_vllm()
        self.path = policy_folder(path, model)
        self.tok, self.format = load_tokenizer_and_format(self.path, eot, prompt_format, padding_side="left")
        self.eot = self.format.end_of_conversation_token
        self.model = load_causal_lm(self.path, self.tok, dtype=self.placement.dtype,
                                    end_of_conversation_token=self.eot).to(self.placement.device).eval()
        self.formatter = PromptFormatter(self.tok, self.format.prompt_format, self.eot)
        self.stop_ids = tuple(stop_token_ids(self.tok, self.eot))
        self.engine = None
        if engine is not None and engine.backend == "vllm":
            from marlhf.vllm_sampler import VLLMSampler

            dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.placement.dtype]
            self.engine = VLLMSampler(self.path, engine, max_model_len=None, dtype=dtype_name, seed=0)
        log.info("policy %s (prompt format %s, end token %r) on %s in %s", self.path, self.format.prompt_format,
                 self.eot, self.placement.device, self.placement.dtype)

    def config(self, sampling: SamplingSection | None = None, *, do_sample: bool = True,
               seed: int | None = None) -> GenerationConfig:
        """How to sample: ``sampling`` (the tool's flags; None: the section's defaults, step 3's) with this policy's
        stop and pad ids."""
        return (sampling or SamplingSection()).generation(self.stop_ids, self.tok.pad_token_id, seed=seed,
                                                          do_sample=do_sample)

    def encode(self, prompts: Sequence[str], max_prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded (ids, mask) of raw prompts in the policy's prompt format; a prompt over
        ``max_prompt_len`` tokens keeps its most recent turns (as step 3 truncates)."""

        fit = LongPromptPolicy("truncate")
        seqs = []
        for p in prompts:
            text, drop = fit.fit(self.formatter, p, max_prompt_len)
            seqs.append(self.formatter.encode(text)[drop:])
        if fit.counts:
            log.info("prompts over %d tokens: %s", max_prompt_len, dict(fit.counts))
        return _pad(seqs, self.tok.pad_token_id, left=True)

    def sample(self, prompts: Sequence[str], cfg: GenerationConfig, num_samples: int, max_prompt_len: int):
        """(responses, ended, lengths) of ``num_samples`` answers per prompt, grouped by prompt."""
        ids, mask = self.encode(prompts, max_prompt_len)
        dev = self.placement.device
        out = sample(self.model, ids.to(dev), mask.to(dev), cfg, num_samples=num_samples) if self.engine is None \
            else self.engine.sample(ids.to(dev), mask.to(dev), cfg, num_samples=num_samples)
        _, responses = decode_samples(self.tok, out)
        return responses, out.ended.tolist(), out.lengths.tolist()


def batch_seed(seed: int, batch: int) -> int:
    """The seed batch ``batch`` samples under: independent of the batches before it (resume = same rows)."""
    return seed * 1_000_003 + batch


# --------------------------------------------------------------------------------------------- the file
def _read_settings(path: Path) -> dict | None:
    side = path.with_name(path.name + SETTINGS_SUFFIX)
    if not side.is_file():
        return None
    try:
        return json.loads(side.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{side}: not valid JSON ({err}); delete it and the rows, or give --overwrite") from None


def _expected_rows(prompts: Sequence[Prompt], batch_size: int, num_samples: int):
    """(prompt_id, sample) of every row in file order, with the batch each belongs to."""
    for b in range(0, len(prompts), batch_size):
        for p in prompts[b:b + batch_size]:
            for k in range(num_samples):
                yield b // batch_size, p.id, k


def resume_point(path: Path, prompts: Sequence[Prompt], batch_size: int, num_samples: int) -> tuple[int, int, int]:
    """(complete batches, rows in them, their byte length) of what ``path`` already holds, checking that every
    row is the expected one.  The part after the last newline (a torn line) and the rows of an incomplete
    last batch are not counted: the caller cuts them off."""
    data = path.read_bytes()
    expected = list(_expected_rows(prompts, batch_size, num_samples))
    batches = rows = size = offset = 0
    for n, line in enumerate(data.split(b"\n")[:-1], 1):  # one write per batch: only the last line can be torn
        offset += len(line) + 1
        try:
            row = json.loads(line)
            key = (row["prompt_id"], row["sample"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path}: row {n} is not a generation row (fields prompt_id, sample); the file was "
                              f"edited or not written by this tool (give --overwrite to start over)") from None
        want = expected[n - 1][1:] if n <= len(expected) else None
        if key != want:
            raise ConfigError(f"{path}: row {n} is {key}, expected {want or 'no more rows'}: the file does not "
                              f"match these prompts (give --overwrite to start over)")
        if n == len(expected) or expected[n][0] != expected[n - 1][0]:  # the last row of its batch
            batches, rows, size = batches + 1, n, offset
    return batches, rows, size


def generate_file(policy: LoadedPolicy, prompts: Sequence[Prompt], output: str | Path, *, cfg: GenerationConfig,
                  num_samples: int = 1, batch_size: int = 8, max_prompt_len: int = 256, seed: int = 0,
                  policy_name: str = "", overwrite: bool = False, progress: bool = True,
                  settings: dict | None = None) -> int:
    """Sample ``num_samples`` answers per prompt into ``output`` (JSON lines), resuming a stopped run.
    Returns the number of rows written by this call."""
    from tqdm.auto import tqdm


    if batch_size < 1 or num_samples < 1:
        raise ConfigError(f"--batch_size and --num_samples must be at least 1, got {batch_size}, {num_samples}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    side = output.with_name(output.name + SETTINGS_SUFFIX)
    # everything that changes the rows: resuming with any of it different would mix two runs in one file
    recorded = {"policy": policy.path, "policy_name": policy_name, "num_prompts": len(prompts),
                "num_samples": num_samples, "batch_size": batch_size, "max_prompt_len": max_prompt_len, "seed": seed,
                "generation": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seed"},
                **(settings or {})}
    recorded = json.loads(json.dumps(recorded))  # tuples -> lists, as they read back
    start = 0
    if output.exists() and not overwrite:
        before = _read_settings(output)
        if before is None:
            raise ConfigError(f"{output} exists without {side.name}: not a file this tool can resume (give "
                              f"--overwrite to replace it, or another --output)")
        changed = sorted(k for k in set(before) | set(recorded) if before.get(k) != recorded.get(k))
        if changed:
            raise ConfigError(f"{output} was sampled with other settings ({', '.join(changed)} differ): resume with "
                              f"the same flags, or give --overwrite / another --output")
        start, kept, size = resume_point(output, prompts, batch_size, num_samples)
        cut = output.stat().st_size - size
        if cut:
            with open(output, "r+b") as f:
                f.truncate(size)
                os.fsync(f.fileno())
            log.info("%s: dropped %d bytes of a torn line / incomplete batch", output, cut)
        if start:
            log.info("%s: resuming after %d complete batches (%d rows)", output, start, kept)
    else:
        output.write_bytes(b"")
    side.write_text(json.dumps(recorded, indent=1) + "\n")
    num_batches = (len(prompts) + batch_size - 1) // batch_size
    done_prompts = min(len(prompts), start * batch_size)
    written = 0
    with open(output, "ab") as f, tqdm(total=len(prompts), initial=done_prompts, unit="prompt",
                                       disable=not progress, desc="generate") as bar:
        for b in range(start, num_batches):
            chunk = prompts[b * batch_size:(b + 1) * batch_size]
            s = batch_seed(seed, b)
            responses, ended, lengths = policy.sample([p.text for p in chunk], dataclasses.replace(cfg, seed=s),
                                                      num_samples, max_prompt_len)
            lines = []
            for i, (resp, end, length) in enumerate(zip(responses, ended, lengths)):
                p = chunk[i // num_samples]
                row = {"prompt_id": p.id, "sample": i % num_samples, "prompt": p.text, "response": resp,
                       "ended": bool(end), "length": int(length), "seed": s, "policy": policy_name}
                lines.append(json.dumps(row, ensure_ascii=False) + "\n")
            f.write("".join(lines).encode("utf-8"))  # one write per batch: a kill leaves at most one torn batch
            f.flush()
            os.fsync(f.fileno())
            written += len(lines)
            bar.update(len(chunk))
            events.reached("generate", b)  # batch b is on disk
    log.info("wrote %d rows to %s (%d in the file)", written, output, len(prompts) * num_samples)
    return written


# ------------------------------------------------------------------------------------ the tools' flags
def add_sampling_args(p: argparse.ArgumentParser, temperature: bool = True) -> None:
    """The policy and sampling flags the generation tools share: sampling as step 3 samples unless told otherwise
    (the flags of :class:`~marlhf.sections.SamplingSection`, step 3's); ``temperature=False``: a tool with a flag of
    its own."""

    p.add_argument("--model", default="", help="HF folder, step output or hub name (empty: the embedded default)")
    p.add_argument("--model_part", default="actor", choices=STEP3_MODELS, help="Which model of a step-3 output")
    add_flags(p, SamplingSection, only=("max_answer_seq_len", "max_prompt_seq_len", "top_k", "top_p")
              + (("temperature",) if temperature else ()),
              help={"max_prompt_seq_len": "Longer prompts keep their most recent turns (as step 3 cuts them)."})
    add_flags(p, DataSection, only=("end_of_conversation_token", "prompt_format"),
              help={"end_of_conversation_token": "Default: the one recorded with the model."})
    add_flags(p, GenerationEngineSection)
    add_flags(p, RobustnessSection, only=("debug",))
    add_placement_args(p)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """``--prompts FILE`` or ``--data_path SPEC… --split`` with the training run's split flags."""

    add_flags(p.add_mutually_exclusive_group(required=True), PromptSource, only=("prompts", "data_path"))
    add_flags(p, PromptSource, only=("split", "phase", "max_prompts"))
    add_flags(p, DataSection, only=("data_split", "data_seed", "eval_fraction", "bad_rows"),
              help={"data_seed": "The training run's split seed: its --data_seed, else its --seed (-1: the default "
                                 "--seed, as a run given neither split)."})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptSource(Section):
    """Where a tool's prompts come from (the flags of :func:`add_prompt_args`): a prompt file, or a dataset's
    share of rows split as training split it (the split flags are :class:`~marlhf.sections.DataSection`'s)."""

    TITLE = "prompts"

    prompts: str | None = flag(None, "json/jsonl/parquet file with a 'prompt' per row.")
    data_path: tuple[str, ...] | None = flag(None, "Dataset specs as in training.")
    split: str = flag("eval", "With --data_path: which prompts.", choices=("eval", "train"))
    phase: int = flag(3, "With --data_path: whose share of the rows (1 SFT, 2 reward model, 3 RLHF), as training "
                      "splits them; 2 gives the prompts to label for a reward model (marlhf label).", choices=(1, 2, 3))
    max_prompts: int = flag(0, "Use the first N prompts (0: all).")
    data_split: str = derived(lambda a: a.data_split)
    data_seed: int = derived(lambda a: a.data_seed if a.data_seed >= 0 else ScheduleSection.seed)
    eval_fraction: float = derived(lambda a: a.eval_fraction)
    bad_rows: str = derived(lambda a: a.bad_rows)

    def load(self) -> list[Prompt]:
        if self.max_prompts < 0:
            raise ConfigError(f"--max_prompts must be >= 0, got {self.max_prompts}")
        if self.prompts:
            prompts = prompts_from_file(self.prompts)
        else:
            prompts = prompts_from_dataset(list(self.data_path), self.split, data_split=self.data_split,
                                           seed=self.data_seed, eval_fraction=self.eval_fraction,
                                           bad_rows=self.bad_rows, phase=self.phase)
        return prompts[:self.max_prompts] if self.max_prompts else prompts
