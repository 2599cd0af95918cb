"""Records -> deterministic phase splits -> tokenized, cached datasets and their collators.

Phase 1 (SFT) trains on prompt + chosen with loss on response tokens; phase 2 (reward model) on
(chosen, rejected) pairs; phase 3 (RLHF) on prompts.  ``--data_split 2,4,4`` gives each dataset's
records to the three phases in those shares, by a seeded permutation, so the phases never overlap.
Evaluation data is the dataset's test split or, when it has none, a seeded held-out slice of train that
no phase sees.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from marlhf.data.adapters import load_records
from marlhf.data.formatting import LongPromptPolicy, PromptFormatter
from marlhf.data.records import BadRowPolicy, DataError, Record
from marlhf.errors import ConfigError
from marlhf.utils import dist

if TYPE_CHECKING:
    from marlhf.sections import DataSection  # the step's data flags (built by the entry point)

log = logging.getLogger("marlhf")

PHASES = {1: "sft", 2: "reward", 3: "rlhf"}
CACHE_VERSION = 3  # 2: phase-3 examples carry their record's meta; 3: phase-2 pairs record where each
#                   response starts (DPO)


# --------------------------------------------------------------------------------------------------------
# splitting
# --------------------------------------------------------------------------------------------------------
def split_indices(n: int, data_split: str, phase: int, seed: int) -> list[int]:
    """Indices of ``n`` records that belong to ``phase`` (1, 2 or 3) under ``data_split``.

    A seeded permutation is cut at the cumulative shares, so the three phases partition range(n)."""
    shares = [float(s) for s in data_split.split(",")]
    total = sum(shares)
    bounds = [0]
    for s in shares:
        bounds.append(bounds[-1] + s)
    cuts = [round(n * b / total) for b in bounds]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[cuts[phase - 1]:cuts[phase]])


def holdout_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a seeded ``fraction`` of ``n`` held out for evaluation."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    k = int(round(n * fraction)) if n > 1 else 0
    return sorted(perm[k:]), sorted(perm[:k])


def phase_records(specs: list[str], data_split: str, phase: int, seed: int, eval_fraction: float,
                  policy: BadRowPolicy) -> tuple[list[Record], list[Record]]:
    """(train, eval) records of ``phase`` over all datasets in ``specs``."""

    train, evaluation = [], []
    for spec in specs:
        records = load_records(spec, split="train", bad_rows=policy)
        if not records:
            raise ConfigError(f"dataset {spec!r} has no usable training rows")
        test = load_records(spec, split="test", bad_rows=policy)
        if test is None:
            keep, held = holdout_indices(len(records), eval_fraction, seed)
            test = [records[i] for i in held]
            records = [records[i] for i in keep]
        train += [records[i] for i in split_indices(len(records), data_split, phase, seed)]
        evaluation += test
        log.info("%s: %d train records for phase %d (%s), %d eval records", spec, len(train), phase,
                 PHASES[phase], len(test))
    return train, evaluation


# --------------------------------------------------------------------------------------------------------
# tokenization
# --------------------------------------------------------------------------------------------------------
def _where(rec: Record) -> tuple[str, int]:
    file, _, row = rec.source.rpartition(":")
    return (file or rec.source or "<records>"), int(row) if row.isdigit() else -1


def encode_pair(tokenizer, prompt: str, response: str, eot: str, max_len: int,
                formatter: PromptFormatter | None = None, cut: int = 0) -> tuple[list[int], int]:
    """Token ids of prompt+response+eot (truncated to ``max_len``) and where the response starts.

    ``prompt`` is already in the prompt format (:meth:`PromptFormatter.prompt_text`); ``cut`` leading tokens
    are dropped (a left-truncated prompt)."""
    fmt = formatter or PromptFormatter(tokenizer, "raw", eot)
    prompt_ids = fmt.encode(prompt)
    full = fmt.encode(prompt + fmt.response_text(response))
    start = 0  # common prefix: joint tokenization may merge across the boundary
    while start < min(len(prompt_ids), len(full)) and prompt_ids[start] == full[start]:
        start += 1
    return full[cut:cut + max_len], start - cut


def _fit_prompt(fmt: PromptFormatter, rec: Record, limit: int, long_prompts: LongPromptPolicy):
    """``--long_prompts`` on ``rec``'s prompt: (formatted text, leading tokens to drop) or None (skipped)."""
    try:
        return long_prompts.fit(fmt, rec.prompt, limit)
    except ValueError as err:
        file, row = _where(rec)
        raise DataError(file, row, "prompt", str(err)) from None


def tokenize_phase(records: list[Record], phase: int, tokenizer, *, eot: str, max_seq_len: int,
                   max_prompt_len: int, policy: BadRowPolicy, prompt_format: str = "raw",
                   long_prompts: LongPromptPolicy | None = None, limit: int = 0,
                   kept: list[Record] | None = None) -> list[dict]:
    """Turn records into the token-id examples of ``phase`` (lists of ints, cheap to cache).

    Prompts are formatted in ``prompt_format`` and fitted by ``long_prompts`` (default: truncate): to
    ``max_prompt_len`` tokens in phase 3; in phases 1-2 a prompt that leaves no room for a response within
    ``max_seq_len`` is cut to half of it.  ``limit`` > 0 stops once that many examples are kept; ``kept``,
    if given, receives the records the examples came from."""
    fmt = PromptFormatter(tokenizer, prompt_format, eot)
    long_prompts = long_prompts if long_prompts is not None else LongPromptPolicy()
    out = []
    for rec in records:
        if limit and len(out) >= limit:
            break
        item = _example(rec, phase, fmt, max_seq_len, max_prompt_len, policy, long_prompts)
        if item is not None:
            out.append(item)
            if kept is not None:
                kept.append(rec)
    return out


def _example(rec: Record, phase: int, fmt: PromptFormatter, max_seq_len: int, max_prompt_len: int,
             policy: BadRowPolicy, long_prompts: LongPromptPolicy) -> dict | None:
    if phase == 3:
        fitted = _fit_prompt(fmt, rec, max_prompt_len, long_prompts)
        if fitted is None:
            return None
        item = {"prompt_ids": fmt.encode(fitted[0])[fitted[1]:]}
        if rec.meta:  # what the reward source needs besides the text (tests, facts): on to the scorer
            item["meta"] = rec.meta
        return item
    fits = len(fmt.encode(fmt.prompt_text(rec.prompt))) < max_seq_len  # room for one response token
    fitted = _fit_prompt(fmt, rec, max_seq_len - 1 if fits else max_seq_len // 2, long_prompts)
    if fitted is None:
        return None
    text, cut = fitted
    if phase == 1:
        ids, start = encode_pair(fmt.tokenizer, text, rec.chosen, fmt.eot, max_seq_len, fmt, cut)
        return {"input_ids": ids, "response_start": start}
    if rec.rejected is None:
        file, row = _where(rec)
        policy.handle(DataError(file, row, "rejected", "missing (a reward model needs preference pairs)"))
        return None
    if rec.rejected == rec.chosen:  # no preference to learn from; the pairwise loss would be log 2
        file, row = _where(rec)
        policy.handle(DataError(file, row, "rejected", "identical to 'chosen' (no preference to learn)"))
        return None
    chosen, chosen_start = encode_pair(fmt.tokenizer, text, rec.chosen, fmt.eot, max_seq_len, fmt, cut)
    rejected, rejected_start = encode_pair(fmt.tokenizer, text, rec.rejected, fmt.eot, max_seq_len, fmt, cut)
    # where each response starts: DPO scores log π(response | prompt) over the response tokens only
    return {"chosen_ids": chosen, "rejected_ids": rejected, "chosen_start": chosen_start,
            "rejected_start": rejected_start}


# --------------------------------------------------------------------------------------------------------
# caching
# --------------------------------------------------------------------------------------------------------
def _source_fingerprint(spec: str) -> list:
    """Local files that feed ``spec`` (size + mtime), so editing a file invalidates the cache."""
    path = spec.split(":", 1)[1] if ":" in spec and not os.path.exists(spec) else spec
    p = Path(path)
    if not p.exists():
        return []
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    return [(str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in files[:10000]]


def cache_key(**parts) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class PhaseData:
    train: list[dict]
    eval: list[dict]
    eval_prompts: list[str]
    eval_records: list[Record]


def build_phase_data(data: DataSection, tokenizer, phase: int) -> PhaseData:
    """Tokenized train/eval examples of ``phase``, from the cache under ``--data_output_path`` when present.

    The first rank of every node builds and writes the cache atomically (nodes need not share a file
    system; on a shared one the identical writes replace each other atomically); the other ranks wait
    and read it."""
    specs = list(data.data_path)
    key = cache_key(specs=specs, split=data.data_split, phase=phase, seed=data.split_seed,
                    eval_fraction=data.eval_fraction, max_eval=data.max_eval_samples,
                    tokenizer=[type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer),
                               tokenizer.padding_side], eot=data.end_of_conversation_token,
                    prompt_format=data.prompt_format, long_prompts=data.long_prompts,
                    max_seq_len=data.max_seq_len, max_prompt=data.max_prompt_seq_len, bad_rows=data.bad_rows,
                    sources=[_source_fingerprint(s) for s in specs])
    path = Path(data.data_output_path) / f"{PHASES[phase]}_{key}.pt"
    with dist.work_for_all():  # the others wait; a bad row stops every rank with one message
        if dist.is_local_main() and not path.exists():
            policy = BadRowPolicy(data.bad_rows)
            train_recs, eval_recs = phase_records(specs, data.data_split, phase, data.split_seed,
                                                  data.eval_fraction, policy)
            long_prompts = LongPromptPolicy(data.long_prompts)
            kw = dict(eot=data.end_of_conversation_token, max_seq_len=data.max_seq_len,
                      max_prompt_len=data.max_prompt_seq_len, policy=policy, prompt_format=data.prompt_format,
                      long_prompts=long_prompts)
            train = tokenize_phase(train_recs, phase, tokenizer, **kw)
            # --max_eval_samples counts examples kept after the length rules, not records read
            kept: list[Record] = []
            evaluation = tokenize_phase(eval_recs, phase, tokenizer, **kw, limit=data.max_eval_samples, kept=kept)
            eval_recs = kept
            log.info("phase %d data: %d train / %d eval examples; %s; %s", phase, len(train), len(evaluation),
                     long_prompts.summary("--max_prompt_seq_len" if phase == 3 else "--max_seq_len"), policy.summary())
            if not train:
                raise ConfigError(f"no training examples left for phase {phase} ({PHASES[phase]}); {policy.summary()}")
            payload = {"train": train, "eval": evaluation, "eval_records": [r.to_dict() for r in eval_recs],
                       "skipped": policy.summary()}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{socket.gethostname()}-{os.getpid()}")
            torch.save(payload, tmp)
            os.replace(tmp, path)  # atomic: a crash never leaves a half-written cache behind
    payload = torch.load(path, weights_only=False)
    if dist.is_main():
        log.info("loaded %s (%d train / %d eval)", path, len(payload["train"]), len(payload["eval"]))
    records = [Record(**r) for r in payload["eval_records"]]
    return PhaseData(payload["train"], payload["eval"], [r.prompt for r in records], records)


def held_out_part(examples: list, part: str) -> list:
    """``part`` of the held-out examples: ``all``, or the interleaved halves ``validation`` (positions 0, 2, ...)
    and ``test`` (1, 3, ...): disjoint, together all of them, each spread over the whole held-out slice."""
    if part == "all":
        return list(examples)
    if part not in ("validation", "test"):
        raise ConfigError(f"--eval_prompts must be all, validation or test, got {part!r}")
    chosen = list(examples[0 if part == "validation" else 1::2])
    if not chosen:
        raise ConfigError(f"--eval_prompts {part}: the held-out slice has {len(examples)} prompt(s), none in the "
                          f"{part} half; hold out more (--eval_fraction, --max_eval_samples) or use all")
    return chosen


# --------------------------------------------------------------------------------------------------------
# datasets and collators
# --------------------------------------------------------------------------------------------------------
class ListDataset(Dataset):
    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _pad(seqs: list[list[int]], pad_id: int, left: bool = False,
         width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs) if width is None else width
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        sl = slice(T - len(s), T) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


class SFTCollator:
    """Right-padded input_ids / attention_mask and labels that ignore padding (-100) and, unless
    ``prompt_loss``, the prompt (DeepSpeed-Chat's step 1 trains on every token of prompt + answer)."""

    def __init__(self, pad_id: int, prompt_loss: bool = False):
        self.pad_id = pad_id
        self.prompt_loss = prompt_loss

    def __call__(self, batch: list[dict]) -> dict:
        ids, mask = _pad([b["input_ids"] for b in batch], self.pad_id)
        labels = ids.clone()
        labels[mask == 0] = -100
        if not self.prompt_loss:
            for i, b in enumerate(batch):
                labels[i, :b["response_start"]] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PairCollator:
    """A batch of preference pairs as its distinct sequences, each prompt's prefix laid out to run once.

    Pairs that share a prompt (K answers ranked per prompt: InstructGPT's batches, or ``marlhf label``'s all
    pairs of K answers) share their sequences: each distinct sequence is one row, and ``chosen`` / ``rejected``
    (B,) say which rows pair i compares, so K answers forwarded once serve their K(K-1)/2 pairs.  Rows come in
    the order they first appear among the chosen then the rejected sequences: a batch of distinct pairs is rows
    [0, B) chosen over [B, 2B) rejected.

    Rows that share a prompt form a group (``prefix_index`` (R,): each row's group) laid out as [left padding,
    the tokens all of the group's rows share, the row's own rest, right padding], the shared part ending at
    column ``prefix_width`` in every group, so that it runs once per group
    (:func:`marlhf.models.forward.pair_hidden_states`); each row keeps at least its last token after it.
    ``response_start`` is each row's first answer column in this layout."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        rows, starts, row_of = [], [], {}

        def row(ids: list[int], start: int) -> int:  # a sequence's row, added when first seen
            if (key := tuple(ids)) not in row_of:
                row_of[key] = len(rows)
                rows.append(ids)
                starts.append(start)
            return row_of[key]

        chosen = [row(b["chosen_ids"], b["chosen_start"]) for b in batch]
        rejected = [row(b["rejected_ids"], b["rejected_start"]) for b in batch]
        group = _prompt_groups(rows, starts, zip(chosen, rejected))
        first, common = {}, {}  # per group: its first row, the columns all its rows share with it
        for r, g in enumerate(group):
            k = _common_prefix(rows[first.setdefault(g, r)], rows[r])
            common[g] = min(common.get(g, k), k)
        shared = [common[g] for g in group]
        width = max(shared)
        prefix, prefix_mask = _pad([ids[:k] for ids, k in zip(rows, shared)], self.pad_id, left=True, width=width)
        rest, rest_mask = _pad([ids[k:] for ids, k in zip(rows, shared)], self.pad_id)
        ids, mask = torch.cat([prefix, rest], dim=1), torch.cat([prefix_mask, rest_mask], dim=1)
        start = torch.tensor([s + width - k for s, k in zip(starts, shared)])
        return {"input_ids": ids, "attention_mask": mask, "response_start": start, "prefix_width": width,
                "prefix_index": torch.tensor(group), "chosen": torch.tensor(chosen), "rejected": torch.tensor(rejected)}


def _prompt_groups(rows: list[list[int]], starts: list[int], pairs) -> list[int]:
    """Each row's group, numbered in order of first appearance: rows with the same prompt tokens, and the two
    rows of a pair (their prompts may tokenize apart where an answer merges with the prompt's last token)."""
    parent = list(range(len(rows)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    by_prompt: dict[tuple, int] = {}
    for r, (ids, s) in enumerate(zip(rows, starts)):
        other = by_prompt.setdefault(tuple(ids[:s]), r)
        parent[root(r)] = root(other)
    for c, r in pairs:
        parent[root(r)] = root(c)
    number: dict[int, int] = {}
    return [number.setdefault(root(r), len(number)) for r in range(len(rows))]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share, leaving each at least one token of its own."""
    limit, k = min(len(a), len(b)) - 1, 0
    while k < limit and a[k] == b[k]:
        k += 1
    return k


class PromptCollator:
    """Left-padded prompts, ready for generation, and each prompt's record meta (a list of dicts, {} when
    the record has none) for the reward source."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        ids, mask = _pad([b["prompt_ids"] for b in batch], self.pad_id, left=True)
        return {"prompt_ids": ids, "prompt_mask": mask, "meta": [b.get("meta", {}) for b in batch]}


# --------------------------------------------------------------------------------------------------------
# data order that survives a restart
# --------------------------------------------------------------------------------------------------------
class ResumableSampler(Sampler):
    """This rank's share of a seeded per-epoch permutation, optionally starting ``skip`` items in.

    Like DistributedSampler (every rank gets ceil(n / world) items, the permutation wrapped to fill), but
    able to continue mid-epoch so a resumed run sees exactly the batches the stopped one would have.

    With ``lengths`` (each item's cost, e.g. its tokens) the permutation is grouped by length, as transformers'
    ``group_by_length``: cut into mega-batches of :data:`MEGA_BATCHES` global batches (``batch_size`` items per
    rank, all ranks), each sorted by length and cut into global batches again, whose order is then shuffled.
    A batch then holds items of similar length and pads little; every item is still seen once per epoch.

    With ``groups`` (each item's group, e.g. the prompt of a preference pair) the groups are permuted instead
    of the items, a group's items staying consecutive, and each rank takes consecutive items of every global
    batch, so that a group is cut only where a batch ends (a batch of K answers' pairs runs each answer once:
    :class:`PairCollator`).  With one item per group this is the plain permutation."""

    MEGA_BATCHES = 50

    def __init__(self, n: int, seed: int, shuffle: bool = True, lengths: list[int] | None = None,
                 batch_size: int = 1, groups: list | None = None):
        for what, given in (("lengths", lengths), ("groups", groups)):
            if given is not None and len(given) != n:
                raise ValueError(f"{len(given)} {what} for {n} items")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.lengths, self.batch_size = lengths, batch_size
        self.members = self.group_of = None
        if groups is not None:  # each group's items, groups in order of first appearance
            members: dict = {}
            for i, g in enumerate(groups):
                members.setdefault(g, []).append(i)
            if len(members) < n:  # else every item is its own group: the plain sampler
                self.members = list(members.values())
                self.group_of = {i: k for k, items in enumerate(self.members) for i in items}
        self.rank, self.world = dist.rank(), dist.world_size()
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def _indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.members is None:
            order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        else:
            perm = torch.randperm(len(self.members), generator=g).tolist() if self.shuffle else range(len(self.members))
            order = [i for k in perm for i in self.members[k]]
        per_rank = math.ceil(self.n / self.world)
        order = (order * math.ceil(per_rank * self.world / max(self.n, 1)))[: per_rank * self.world]
        if self.lengths is not None:
            order = self._grouped(order, g)
        if self.members is not None and self.world > 1:
            order = self._rank_contiguous(order)
        return order[self.rank::self.world]

    def _grouped(self, order: list[int], g: torch.Generator) -> list[int]:
        """``order`` with each mega-batch sorted by length (longest first) and its global batches shuffled; a
        last, partial global batch stays last, so that every other one keeps its place across the ranks.
        With groups, a group sorts as one block (by its longest item)."""
        step = self.batch_size * self.world  # a global batch: rank r takes its items r, r + world, ...
        mega = step * self.MEGA_BATCHES
        out = []
        for m in range(0, len(order), mega):
            chunk = sorted(order[m:m + mega], key=self._length_key(order[m:m + mega]))
            batches = [chunk[b:b + step] for b in range(0, len(chunk), step)]
            full = len(batches) - (len(batches[-1]) < step)
            out += [i for k in torch.randperm(full, generator=g).tolist() + list(range(full, len(batches)))
                    for i in batches[k]]
        return out

    def _length_key(self, chunk: list[int]):
        """Longest first; with groups, a group's items as one block at its longest item's place (ties: in
        the order the groups come in ``chunk``)."""
        if self.members is None:
            return lambda i: -self.lengths[i]
        group_of, longest, first = self.group_of, {}, {}
        for pos, i in enumerate(chunk):
            k = group_of[i]
            longest[k] = max(longest.get(k, 0), self.lengths[i])
            first.setdefault(k, pos)
        return lambda i: (-longest[group_of[i]], first[group_of[i]])

    def _rank_contiguous(self, order: list[int]) -> list[int]:
        """``order`` rearranged so that ``[rank::world]`` gives each rank a consecutive run of every global
        batch (rank r: the r-th of its ``world`` equal parts) instead of every world-th item."""
        step, out = self.batch_size * self.world, []
        for b in range(0, len(order), step):
            chunk = order[b:b + step]
            q = len(chunk) // self.world  # the wrap above makes every chunk a multiple of world
            out += [chunk[r * q + j] for j in range(q) for r in range(self.world)]
        return out

    def __iter__(self):
        return iter(self._indices()[self.skip:])

    def __len__(self) -> int:
        return math.ceil(self.n / self.world) - self.skip


def plan_steps(num_items: int, batch_size: int, batches_per_step: int, epochs: int, max_steps: int,
               what: str = "examples") -> tuple[int, int]:
    """(steps per epoch, total steps) when each rank takes ``batch_size`` items per batch from its
    ResumableSampler share and one optimizer step consumes ``batches_per_step`` batches.

    Steps 1-3 all count this way, and step 3 needs the total before its engines (schedulers) exist."""
    per_rank = math.ceil(num_items / dist.world_size())
    steps_per_epoch = math.ceil(per_rank / batch_size) // batches_per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"{num_items} {what} are too few for one optimizer step (batch {batch_size} x "
                         f"{batches_per_step} batches per step x {dist.world_size()} ranks)")
    total = steps_per_epoch * epochs
    return steps_per_epoch, min(total, max_steps) if max_steps else total


def make_loader(items: list[dict], batch_size: int, sampler: Sampler, collate_fn) -> DataLoader:
    """A DataLoader that draws nothing from the global RNG (its own generator), so restoring the RNG state
    on resume reproduces the uninterrupted run's dropout and sampling exactly."""
    return DataLoader(ListDataset(items), batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=torch.Generator())
