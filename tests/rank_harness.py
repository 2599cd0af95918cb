"""Run a function on two CPU ranks (one gloo process group, started with torch.multiprocessing) and collect
what each rank returned: for unit tests of collective helpers without the ``deepspeed`` launcher.

Each rank gets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* as a launcher would set them and one compute thread.
``body(rank, *args)`` runs after :func:`marlhf.utils.dist.init_distributed`; its return value (anything
``torch.save`` takes) comes back in a list indexed by rank.  An exception in a rank fails the call with that
rank's traceback."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch


def _rank_main(rank: int, world: int, port: int, out: str, body, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result: dict = {}
    try:
        from marlhf.utils import dist

        dist.init_distributed()
        result["value"] = body(rank, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    import torch.distributed as tdist

    if tdist.is_initialized() and "error" not in result:
        tdist.destroy_process_group()


def run_ranks(body, out: Path, *args, world: int = 2, timeout: float = 180) -> list:
    """``body(rank, *args)`` on ``world`` ranks; the list of their return values."""
    import torch.multiprocessing as mp

    from marlhf.utils.dist import _free_port

    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_rank_main, args=(world, _free_port(), str(out), body, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:  # a rank waits in a collective another rank never entered
            for proc in ctx.processes:
                proc.kill()
            done = sorted(p.name for p in out.glob("rank*.pt"))
            raise AssertionError(f"the ranks did not finish within {timeout} s (hung?); finished: {done}")
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(errors)
    return [res["value"] for res in results]
