"""Time the parsing termination rule (ParseSegmenter.starts) on a step-sized batch, CPU only.

    python scripts/bench_parsing.py [--batch 64] [--words 60] [--lines 30] [--repeats 5]
                                    [--unfinished 0.25] [--benepar_model PATH_OR_NAME]
                                    [--out bench_results/parsing.json]

Text: `--batch` generated responses of ~`--words` words (spaCy and benepar backends; benepar loads
`--benepar_model`, else benepar_en3 if installed, else the project-built model, built on first use).
Code: `--batch` generated Python snippets of ~`--lines` lines, a fraction `--unfinished` cut mid-line as a
generation hitting its length limit (tree-sitter and redbaron backends; redbaron falls back on those).
Offsets come from a word tokenizer and from a byte-level BPE trained here in memory.
Prints ms per batch and per sample; writes --out JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from marlhf.parsing import ParseSegmenter, available_backends  # noqa: E402

WHO = ["my roommate", "my sister", "our neighbour", "my boyfriend", "a coworker", "my landlord", "the kid next door"]
WHAT = ["borrows my car without asking", "keeps eating my food", "plays loud music at night",
        "never pays the rent on time", "leaves dirty dishes in the sink", "takes credit for my work"]
TRIED = ["talking to them calmly", "leaving a polite note", "asking a friend for advice", "ignoring it for a month",
         "setting up a shared calendar", "writing down every incident"]
ASK = ["Should I confront them directly", "Is it reasonable to involve the landlord",
       "How do I bring this up without a fight", "Would moving out be an overreaction"]
FILL = ["Honestly,", "To be fair,", "Last week,", "For context,", "On top of that,", "Since then,"]


def make_text(rng: random.Random, n_words: int) -> str:
    """A TL;DR-style post/summary of roughly n_words words from seeded vocabularies."""
    sents: list[str] = []
    while sum(len(s.split()) for s in sents) < n_words:
        kind = rng.randrange(4)
        if kind == 0:
            sents.append(f"{rng.choice(FILL)} {rng.choice(WHO)} {rng.choice(WHAT)}, and it has been going on "
                         f"for {rng.randint(2, 11)} weeks.")
        elif kind == 1:
            sents.append(f"I tried {rng.choice(TRIED)} and {rng.choice(TRIED)}, but nothing really changed.")
        elif kind == 2:
            sents.append(f"{rng.choice(ASK)}?")
        else:
            sents.append(f"The {rng.randint(23, 41)}-year-old {rng.choice(WHO).split()[-1]} said that "
                         f"{rng.choice(WHO)} {rng.choice(WHAT)} when nobody is home.")
    return " ".join(sents)


def make_code(rng: random.Random, n_lines: int) -> str:
    """An APPS-style solution of roughly n_lines lines: reading input, helpers, loops, conditionals."""
    lines = ["import sys", "", "", "def read_ints():", "    return list(map(int, sys.stdin.readline().split()))", ""]
    k = 0
    while len(lines) < n_lines - 4:
        k += 1
        v = rng.choice(["a", "b", "xs", "total", "best"])
        body = rng.randrange(3)
        lines += [f"def helper_{k}({v}, n):", f"    result_{k} = 0", f"    for i in range({rng.randint(1, 9)}, n):"]
        if body == 0:
            lines += [f"        if {v}[i] % {rng.randint(2, 7)} == 0:", f"            result_{k} += {v}[i]",
                      "        else:", f"            result_{k} -= 1"]
        elif body == 1:
            lines += [f"        result_{k} = max(result_{k}, {v}[i] * {rng.randint(2, 5)} - i)"]
        else:
            lines += [f"        while result_{k} < {v}[i]:", f"            result_{k} += i + {rng.randint(1, 3)}"]
        lines += [f"    return result_{k}", "", ""]
    lines += ["n = int(input())", "xs = read_ints()", f"print(helper_{max(k, 1)}(xs, n))", ""]
    return "\n".join(lines)


def word_offsets(text: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]", text)]


def bpe_tokenizer(corpus: list[str]):
    import tokenizers

    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus, vocab_size=2000, min_frequency=2, show_progress=False)
    return lambda text: [tuple(o) for o in tok.encode(text).offsets]


def time_case(seg: ParseSegmenter, texts: list[str], offsets: list, repeats: int) -> dict:
    T = max(len(o) for o in offsets)
    t0 = time.perf_counter()
    seg.starts(texts, offsets, T)  # first call: includes loading the parser
    first_ms = (time.perf_counter() - t0) * 1e3
    totals, parses = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        starts, fell_back = seg.starts(texts, offsets, T)
        totals.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        seg.backend.parse(texts)
        parses.append((time.perf_counter() - t0) * 1e3)
    n_tok = sum(len(o) for o in offsets)
    med = statistics.median(totals)
    return {
        "first_call_ms": first_ms,
        "ms_per_batch_median": med,
        "ms_per_batch_min": min(totals),
        "ms_per_sample": med / len(texts),
        "parser_only_ms_median": statistics.median(parses),
        "tokens_per_batch": n_tok,
        "macros_per_batch": int(starts.sum()),
        "mean_macro_len": n_tok / max(int(starts.sum()), 1),
        "fallbacks_per_batch": int(fell_back.sum()),
        "fallback_reasons_last_batch": sorted({d.split(" ", 2)[2].split(" ")[0] for d in seg.last_details}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--words", type=int, default=60)
    ap.add_argument("--lines", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unfinished", type=float, default=0.25, help="fraction of code cut mid-line")
    ap.add_argument("--cutoff", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--benepar_model", default=None, help="benepar model name or folder (default: see above)")
    ap.add_argument("--out", default="bench_results/parsing.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    texts = [make_text(rng, args.words) for _ in range(args.batch)]
    codes = [make_code(rng, args.lines) for _ in range(args.batch)]
    n_cut = int(round(args.unfinished * args.batch))
    for i in range(n_cut):  # a generation stopped by max length: cut inside the last third
        c = codes[i]
        codes[i] = c[: rng.randint(2 * len(c) // 3, len(c) - 2)]
    bpe = bpe_tokenizer(texts + codes)

    backends = available_backends()
    cases = []
    if backends["spacy"]:
        cases.append(("text", "spacy", texts))
    if backends["benepar"]:
        cases.append(("text", "benepar", texts))
    if backends["treesitter"]:
        cases.append(("code", "treesitter", codes))
    if backends["redbaron"]:
        cases.append(("code", "redbaron", codes))

    results = {}
    for kind, backend, data in cases:
        model = args.benepar_model if backend == "benepar" else None
        seg = ParseSegmenter(kind, backend=backend, cutoff=args.cutoff, model=model)
        if backend == "benepar":
            args.benepar_model = seg.backend.model  # recorded in the report
        for tok_name, tok in [("word", word_offsets), ("bpe", bpe)]:
            offsets = [tok(t) for t in data]
            name = f"{kind}/{backend}/{tok_name}"
            results[name] = r = time_case(seg, data, offsets, args.repeats)
            print(f"{name:28s} {r['ms_per_batch_median']:8.1f} ms/batch  {r['ms_per_sample']:6.2f} ms/sample  "
                  f"(parser {r['parser_only_ms_median']:.1f} ms, first call {r['first_call_ms']:.0f} ms, "
                  f"{r['tokens_per_batch']} tokens, mean macro {r['mean_macro_len']:.2f} tokens, "
                  f"fallbacks {r['fallbacks_per_batch']}/{len(data)})")

    report = {
        "config": {
            **vars(args),
            "mean_words_text": statistics.mean(len(t.split()) for t in texts),
            "mean_lines_code": statistics.mean(c.count("\n") + 1 for c in codes),
            "backends_available": backends,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
