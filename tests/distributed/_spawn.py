"""Run cells in-process on a gloo group of N ranks (torch.multiprocessing), no torchrun per cell.

One process group runs many cells in turn, which keeps the distributed tier fast; the cells
themselves go through the same ``harness.run.worker.run_cell`` torchrun uses.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.run import claims
from harness.spec import CellConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cells: list[dict], out: str, inject: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from harness.run.worker import run_cell
    from harness.spec import CellConfig

    if inject is not None:  # a test's fault, installed in this rank before any cell runs
        module, fn = inject.split(":")
        getattr(importlib.import_module(module), fn)(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for raw in cells:
        cfg = CellConfig.from_dict(raw)
        cell_dir = Path(out) / cfg.cell_id
        cell_dir.mkdir(parents=True, exist_ok=True)
        res = run_cell(cfg, cell_dir)
        if rank == 0:
            results[cfg.cell_id] = {**res, "config": cfg.to_dict()}
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_cells(cells: list[dict], world: int, out: Path, inject: str | None = None) -> dict:
    """Run ``cells`` (CellConfig dicts, all with this world size) and return rank 0's results by cell id.

    ``inject``: ``"module:function"``, called with the rank in every rank process before the
    cells run (test-only faults: the harness has no such hook).
    """
    out.mkdir(parents=True, exist_ok=True)
    try:
        _spawn(world, cells, out, inject)
    except mp.ProcessExitedException as e:
        # gloo's TCP transport can abort a rank from its own thread while pairs connect on a busy
        # machine (an uncaught gloo exception: SIGABRT, seen once in CI at world 4; pytorch#188266).
        # The group runs once more on a fresh port; a fault of the harness aborts again and fails.
        if e.signal_name != "SIGABRT":
            raise
        warnings.warn(f"rank {e.error_index} aborted (SIGABRT) at world {world}; the group ran once more", stacklevel=2)
        _spawn(world, cells, out, inject)
    results = json.loads((out / "results.json").read_text())
    if inject is None:  # an honest run: every claim its records would make holds (harness.run.claims)
        for cid, r in results.items():
            lie = claims.contradicted(claims.judge(CellConfig.from_dict(r["config"]), r["metrics"]))
            assert lie is None, f"{cid}: {lie}"
    return results


PRELOAD = ("torch", "torch.distributed", "harness.run.worker", "harness.fit.role_process")
"""What the test session's fork server imports once (~5 s of CPU per process here: torch, DTensor, the
pipelining schedules' dynamo); every rank of every group then forks from it instead of importing anew,
as the harness's own fork server does for a sweep's cells (issue 43: the tiers are CPU-bound)."""


def start_ranks(fn, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` in ``world`` processes forked from the session's preloaded fork server.

    The fork server starts on first use with this process's environment and ``sys.path``; a rank's
    own variables (rendezvous, rank) are set inside ``fn``."""
    mp.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(fn, args=args, nprocs=world, start_method="forkserver")


def _spawn(world: int, cells: list[dict], out: Path, inject: str | None) -> None:
    start_ranks(_rank_main, (world, _free_port(), cells, str(out), inject), world)


def cell(strategy: str, world: int, **kw) -> dict:
    base = dict(size="tiny", strategy=strategy, precision="fp32", world_size=world, global_batch=8, seq_len=64,
                steps=5, warmup=1, device_kind="cpu", nvtx=False, lr=1e-3, base_lr=1e-3, base_batch=8)
    base.update(kw)
    return base
