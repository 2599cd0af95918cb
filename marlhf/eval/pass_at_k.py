"""pass@k, the unbiased estimator of Chen et al. (2021), per APPS difficulty and overall (paper §4.4, Table 3).

With n samples of a problem of which c pass all tests, pass@k = 1 - C(n-c, k) / C(n, k): the probability
that a random k-subset of the n samples holds at least one correct program.  Computed as a product
(1 - C(n-c,k)/C(n,k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)) so large n never overflows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

OVERALL = "overall"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct."""
    if not (0 <= c <= n and k >= 1):
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_table(counts: Iterable[tuple[str, int, int]], ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """Mean pass@k over problems, per difficulty and over all problems.

    ``counts``: one (difficulty, n, c) per problem.  Returns
    ``{difficulty or "overall": {"problems": count, "pass@1": ..., "pass@5": ...}}``.
    """
    groups: dict[str, list[tuple[int, int]]] = {}
    for difficulty, n, c in counts:
        groups.setdefault(difficulty, []).append((n, c))
        groups.setdefault(OVERALL, []).append((n, c))
    if not groups:
        raise ValueError("pass@k of no problems")
    table = {}
    for group, rows in groups.items():
        table[group] = {"problems": len(rows)}
        for k in ks:
            table[group][f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in rows) / len(rows)
    return table
