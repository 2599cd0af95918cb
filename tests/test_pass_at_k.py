"""pass@k (Chen et al. 2021) against a brute-force count over all k-subsets, and its per-difficulty table."""

import itertools
import math

import pytest
from conftest import cli_cmd

from marlhf.eval.pass_at_k import pass_at_k, pass_at_k_table


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_closed_form_and_edges():
    assert pass_at_k(200, 13, 1) == pytest.approx(13 / 200)  # pass@1 is the fraction correct
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # only 2 wrong samples: every 3-subset holds a correct one
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_table_per_difficulty_and_overall():
    counts = [("introductory", 5, 5), ("introductory", 5, 0), ("interview", 5, 1), ("competition", 5, 0)]
    table = pass_at_k_table(counts, ks=[1, 5])
    # introductory: (1 + 0)/2 at k=1; k=5 uses all samples: (1 + 0)/2
    assert table["introductory"] == {"problems": 2, "pass@1": 0.5, "pass@5": 0.5}
    assert table["interview"] == {"problems": 1, "pass@1": pytest.approx(0.2), "pass@5": 1.0}
    assert table["competition"] == {"problems": 1, "pass@1": 0.0, "pass@5": 0.0}
    assert table["overall"]["problems"] == 4
    assert table["overall"]["pass@1"] == pytest.approx((1 + 0 + 0.2 + 0) / 4)
    assert table["overall"]["pass@5"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    with pytest.raises(ValueError, match="no problems"):
        pass_at_k_table([], ks=[1])


def test_cli_runs_programs_in_the_sandbox(tmp_path):
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).parents[1]
    apps = repo / "tests/fixtures/apps_sample"
    good = json.loads((apps / "4184/solutions.json").read_text())[0]
    rows = [{"problem_id": "4184", "response": f"```python\n{good}```"},
            {"problem_id": "4184", "response": "def is_prime(n):\n    return False"},
            {"problem_id": "0001", "response": "print(-1)"},
            {"problem_id": "0001", "response": "syntax error("}]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([*cli_cmd("pass_at_k"), "--problems", str(apps),
                          "--samples", str(samples), "--k", "1", "2", "--workers", "2"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["problems"]["4184"] == {"n": 2, "c": 1, "difficulty": "introductory"}
    assert report["problems"]["0001"]["c"] == 0
    assert report["pass_at_k"]["introductory"] == {"problems": 1, "pass@1": 0.5, "pass@2": 1.0}
    assert report["pass_at_k"]["overall"] == {"problems": 2, "pass@1": 0.25, "pass@2": 0.5}
