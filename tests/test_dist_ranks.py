"""Rank-level behaviour a GPU cluster depends on, tested on two CPU ranks (tests/rank_harness.py):

* decisions read from files are taken on global rank 0 and broadcast, so two nodes that do not share the output
  folder still take the same branch (no rank skips a collective the others enter);
* a run that writes checkpoints refuses, on every rank, an output folder the nodes do not share;
* the accelerator's local device is set before the process group starts;
* every rank samples from its own random stream once the models are built, which are built alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rank_harness import run_ranks

from marlhf.errors import ConfigError, UserError


# ------------------------------------------------------------------------- two nodes, no shared folder
def _two_nodes_body(rank: int, root: str) -> dict:
    from marlhf.utils import checkpoint, dist

    own = Path(root) / f"node{rank}"  # each rank's --output_dir: the same path on two machines, simulated
    common = Path(root) / "shared"
    out: dict = {"shared": dist.shares_folder(common), "own": dist.shares_folder(own)}
    out["record"] = checkpoint.resumed_record(own / "initial_policy.json", resume=True)
    out["record_no_resume"] = checkpoint.resumed_record(own / "initial_policy.json", resume=False)
    out["latest"] = dist.decide_on_main(lambda: checkpoint._latest_state(own / "checkpoints"))
    out["warned_only"] = checkpoint.require_shared_output(own)  # no checkpoints: a warning, False
    for flags in ({"save_steps": 2}, {"resume": True}):
        try:
            checkpoint.require_shared_output(own, **flags)
            out[f"refused {flags}"] = None
        except ConfigError as err:
            out[f"refused {flags}"] = str(err)
    out["shared_ok"] = checkpoint.require_shared_output(common, save_steps=2, resume=True)

    def fail():
        raise ConfigError("bad flag on rank 0")

    try:
        dist.decide_on_main(fail)
    except UserError as err:
        out["error"] = str(err)
    return out


def test_two_nodes_without_a_shared_folder_decide_on_rank_0(tmp_path):
    node0 = tmp_path / "node0"
    (node0 / "checkpoints/step00000004").mkdir(parents=True)
    (node0 / "checkpoints/step00000004/trainer_state.json").write_text(json.dumps({"step": 4, "epoch": 0}))
    (node0 / "checkpoints/latest").write_text("step00000004")
    (node0 / "initial_policy.json").write_text(json.dumps({"gold_score": 0.25}))
    (tmp_path / "node1").mkdir()  # node 1's folder of the same path: empty

    r0, r1 = run_ranks(_two_nodes_body, tmp_path / "ranks", str(tmp_path))
    assert (r0["shared"], r1["shared"]) == (True, True)
    assert (r0["own"], r1["own"]) == (False, False)  # rank 0's token is not in node 1's folder: both know it
    # node 1 has no initial_policy.json and no checkpoint, yet takes rank 0's branch (before: None -> it would
    # evaluate alone and wait forever in the evaluation's all-reduce)
    assert r0["record"] == r1["record"] == {"gold_score": 0.25}
    assert r0["record_no_resume"] is None and r1["record_no_resume"] is None
    assert r0["latest"] == r1["latest"] == (str(node0 / "checkpoints/step00000004"), {"step": 4, "epoch": 0})
    assert r0["warned_only"] is False and r1["warned_only"] is False
    for r in (r0, r1):  # refused on every rank, so no rank goes on alone
        assert "--save_steps: the ranks do not see the same --output_dir" in r["refused {'save_steps': 2}"]
        assert "filesystem all nodes share" in r["refused {'save_steps': 2}"]
        assert r["refused {'resume': True}"].startswith("--resume: the ranks do not see the same --output_dir")
        assert r["shared_ok"] is True
    assert r0["error"] == "bad flag on rank 0"
    assert r1["error"] == "stopped because rank 0 reported an error (rank 0 prints it)"
    assert not list((tmp_path / "shared").glob(".marlhf-shared-*"))  # the token files are removed


# ------------------------------------------------------------------------------------------ seeds
def _seed_body(rank: int) -> dict:
    from marlhf.utils import dist

    dist.set_seed(11)
    layer = torch.nn.Linear(8, 8)  # "model init": drawn before seed_rank_streams
    dist.seed_rank_streams(11)
    probs = torch.full((32,), 1 / 32)
    return {"weight": layer.weight.detach().clone(), "draws": torch.multinomial(probs, 20, replacement=True),
            "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5)}


def test_ranks_share_the_model_init_but_sample_their_own_streams(tmp_path):
    from marlhf.utils import dist

    r0, r1 = run_ranks(_seed_body, tmp_path)
    assert torch.equal(r0["weight"], r1["weight"])
    assert not torch.equal(r0["draws"], r1["draws"])  # same distribution, different samples
    assert not torch.equal(r0["dropout"], r1["dropout"])
    # rank 0 continues the stream a one-rank run has (recorded one-rank runs are unchanged)
    dist.set_seed(11)
    torch.nn.Linear(8, 8)
    dist.seed_rank_streams(11)
    assert torch.equal(torch.multinomial(torch.full((32,), 1 / 32), 20, replacement=True), r0["draws"])


# ----------------------------------------------------------------------------- device before group
class _FakeAccelerator:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def device_name(self, index=None):
        return self.name if index is None else f"{self.name}:{index}"

    def set_device(self, index):
        self.calls.append(("set_device", index))


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_local_device_is_set_before_the_process_group(monkeypatch, accelerator):
    import deepspeed
    import deepspeed.accelerator

    from marlhf.utils import dist

    calls: list = []
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _FakeAccelerator(accelerator, calls))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: calls.append(("init_process_group",)))
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "29999" if var == "MASTER_PORT" else "127.0.0.1" if var == "MASTER_ADDR" else "4")
    dist.init_distributed()
    if accelerator == "cuda":
        assert calls == [("set_device", 3), ("init_process_group",)]
    else:  # the CPU accelerator has no device to select
        assert calls == [("init_process_group",)]
