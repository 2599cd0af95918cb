"""scripts/lowprob_threshold.py: how finely the low-probability rule splits answers at each τ, checked against a
count written out token by token, and the script end to end on the embedded policy."""
import importlib.util
import json
import math
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lowprob_threshold", REPO / "scripts" / "lowprob_threshold.py")
lowprob_threshold = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowprob_threshold)


def loop_counts(mask, logprobs, tau):
    """Actions per answer by hand: one for the first token, one more after every earlier low-probability token."""
    counts = []
    for b in range(mask.shape[0]):
        toks = [float(logprobs[b, t]) for t in range(mask.shape[1]) if mask[b, t]]
        if toks:
            counts.append(1 + sum(1 for x in toks[:-1] if x < math.log(tau)))
    return counts


def test_split_table_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 1, 0, 12, 5])
    mask = torch.arange(12)[None] < lengths[:, None]
    logprobs = torch.log(torch.rand(5, 12, generator=g))
    rows = {r["rule"]: r for r in lowprob_threshold.split_table(mask, logprobs, (0.2, 0.5, 0.9), (1, 5))}
    for tau in (0.2, 0.5, 0.9):
        counts = loop_counts(mask, logprobs, tau)
        row = rows[f"lowprob τ={tau:g}"]
        assert math.isclose(row["actions_per_answer"], sum(counts) / len(counts))
        assert math.isclose(row["tokens_per_action"], 25 / sum(counts))
    assert math.isclose(rows["fixed n=1"]["actions_per_answer"], 25 / 4)  # the empty answer is not counted
    assert math.isclose(rows["fixed n=5"]["actions_per_answer"], (2 + 1 + 3 + 1) / 4)


def test_script_on_the_embedded_policy(tmp_path, embedded):
    from marlhf import embedded as emb

    nano = emb.prepare(size="nano").model_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"POST: a post about pet {i}.\nTL;DR:"}) for i in range(6)))
    out = tmp_path / "table.json"
    assert lowprob_threshold.main(["--policy", str(nano), "--prompts", str(prompts), "--num_prompts", "4",
                                   "--batch_size", "3", "--max_answer_seq_len", "8", "--thresholds", "0.5", "0.99",
                                   "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["answers"] == 4
    low, high = table["rows"][0], table["rows"][1]
    # a higher τ ends actions at more tokens: never fewer actions
    assert high["actions_per_answer"] >= low["actions_per_answer"] >= 1
    assert table["low_probability_tokens"]["0.99"] >= table["low_probability_tokens"]["0.5"]
