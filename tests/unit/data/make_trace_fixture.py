"""Regenerate the CPU gloo torch.profiler trace fixtures (not a test).

Spawns 2 gloo ranks on loopback, trains a tiny ``nn.Linear`` under
DistributedDataParallel for 6 steps with ``schedule(wait=1, warmup=1, active=2)``
and writes ``trace_cpu_gloo_rank{r}.json.gz`` next to this file, unmodified apart from
gzip: the tiny model keeps each file near 10 KB, far below the 200 KB fixture budget.

Usage::

    PYTHONPATH=. python tests/unit/data/make_trace_fixture.py
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule

OUT_DIR = Path(__file__).resolve().parent
WORLD_SIZE = 2
STEPS = 6


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, port: int, tmp_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw_path = Path(tmp_dir) / f"rank{rank}.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(raw_path)),
    ) as prof:
        for _ in range(STEPS):
            x = torch.randn(32, 64)
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            prof.step()
    dist.barrier()
    trace = json.loads(raw_path.read_text())
    out = OUT_DIR / f"trace_cpu_gloo_rank{rank}.json.gz"
    with gzip.open(out, "wt", encoding="utf-8") as fh:
        json.dump(trace, fh, separators=(",", ":"))
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_dir:
        mp.spawn(_worker, args=(_free_port(), tmp_dir), nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        path = OUT_DIR / f"trace_cpu_gloo_rank{rank}.json.gz"
        print(f"{path}: {path.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
