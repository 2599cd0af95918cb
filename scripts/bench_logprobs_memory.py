"""Memory of chosen-token log-probs, plain (float32 copy + logsumexp) against chunked (marlhf.models.logprobs).

For each vocabulary size and method, a fresh process builds bf16 logits ``hidden @ W`` of N positions and runs
forward + backward of Σ log p(target).  Reported per method:

* ``saved``: bytes autograd keeps for backward beyond the projection's own input (``saved_tensors_hooks``);
* ``peak``: the process's peak resident memory during forward + backward above its resident memory just before
  (``ru_maxrss``; CPU allocations, so it counts what a GPU's caching allocator would have to hold at once).

    python scripts/bench_logprobs_memory.py [--rows 512] [--vocab 32000 128000 256000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(method: str, rows: int, vocab: int, hidden: int = 64) -> dict:
    import torch

    from marlhf.models.logprobs import head_token_logprobs, token_logprobs

    torch.manual_seed(0)
    h = torch.randn(rows, hidden).to(torch.bfloat16).requires_grad_()
    w = torch.randn(hidden, vocab).to(torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,))

    def plain():
        x = (h @ w).float()
        return x.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)

    run = {"plain": plain, "chunked": lambda: token_logprobs(h @ w, t),
           "head": lambda: head_token_logprobs(head, h, t)}[method]
    seen: dict[int, int] = {}

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in (w.untyped_storage().data_ptr(), head.weight.untyped_storage().data_ptr()):
            seen[s.data_ptr()] = s.nbytes()
        return x

    base = _rss()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = run()
    out.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"method": method, "rows": rows, "vocab": vocab, "saved": sum(seen.values()), "peak": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, nargs="+", default=[32_000, 128_000, 256_000])
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # internal: method rows vocab, in a fresh process
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]), int(a.one[2]))))
        return
    print(f"{'V':>8} {'method':>8} {'logits MiB':>11} {'saved MiB':>10} {'peak MiB':>9}")
    for vocab in a.vocab:
        for method in ("plain", "chunked", "head"):
            out = subprocess.run([sys.executable, __file__, "--one", method, str(a.rows), str(vocab)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            mib = 2 ** 20
            print(f"{vocab:>8} {method:>8} {a.rows * vocab * 2 / mib:>11.1f} {r['saved'] / mib:>10.1f} "
                  f"{r['peak'] / mib:>9.1f}")


if __name__ == "__main__":
    main()
