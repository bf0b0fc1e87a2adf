"""Measured collective bus bandwidth per collective and message size, cached next to the matmul peak.

Definitions follow nccl-tests ``doc/PERFORMANCE.md`` (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
The message size ``S`` of one call, per rank:

* all_reduce, broadcast: the tensor's size;
* all_gather: the gathered (output) size, each rank contributing ``S/n``;
* reduce_scatter: the input size, each rank ending with ``S/n``;
* all_to_all: the input size per rank;
* send_recv: the bytes each rank sends (ring: rank r sends to r+1 and receives from r-1).

``algbw = S / t`` and ``busbw = algbw * factor(n)`` with factor ``2(n-1)/n`` for all_reduce,
``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, ``1`` for broadcast and send_recv
(``harness.measure.comm_counter.BUS_FACTOR``): busbw is the per-link rate a ring algorithm needs to
reach that algbw, so it is comparable across collectives and rank counts and with the link's
peak. ``t`` is the time of one call, the slowest rank's (nccl-tests reports the same max).

``python -m harness.calibration.collectives --out FILE.json ...`` is the per-rank entry point
torchrun starts; :func:`calibrate_comm` launches it and keeps the result in the calibration
store (:mod:`harness.calibration.store`) as an entry of kind ``comm``. The performance model
fits it in :mod:`harness.model.comm_fit`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from harness.calibration import matmul as calibrate
from harness.calibration import store
from harness.jobs import free_port, run_job
from harness.measure.comm_counter import BUS_FACTOR
from harness.records.atomic import write_json_atomic
from harness.spec import threads_per_rank

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
WARMUP_CALLS = 5
"""Untimed calls before each (collective, size), as nccl-tests' default ``-w 5``."""
BUDGET_S = 0.3
"""Measured time per (collective, size) is capped near this: the call count comes from the warmup's time."""
LAUNCH_TIMEOUT_S = 600.0
COMM_MIN_BYTES = 4 << 10
COMM_MAX_BYTES = 64 << 20
"""Default message sizes of the bus-bandwidth calibration: DDP's 25 MiB buckets and FSDP groups fall inside."""
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``'4MiB'``, ``'1KiB'``, ``'1048576'`` -> bytes (binary units only; ``MB`` is refused as ambiguous)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or int(m.group(1)) < 1:
        raise ValueError(f"{text!r} is not a size; give a positive integer of bytes or a KiB/MiB/GiB suffix, e.g. 4MiB")
    return int(m.group(1)) * _UNITS[unit]


def human_bytes(n: int) -> str:
    """64KiB, 1MiB, 4092B: the largest binary unit that n reaches (one decimal when not whole)."""
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= unit:
            return f"{n // unit}{suffix}" if n % unit == 0 else f"{n / unit:.1f}{suffix}"
    return f"{n}B"


def bus_factor(collective: str, world_size: int) -> float:
    if collective not in BUS_FACTOR:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    return BUS_FACTOR[collective](world_size)


def bandwidths(collective: str, world_size: int, nbytes: int, time_s: float) -> tuple[float, float]:
    """``(algbw_gbps, busbw_gbps)`` for one call of ``nbytes`` (nccl-tests S) taking ``time_s``; GB/s = 1e9 B/s."""
    algbw = nbytes / time_s / 1e9
    return algbw, algbw * bus_factor(collective, world_size)


def sizes(min_bytes: int, max_bytes: int, world_size: int) -> list[int]:
    """x2 steps from min to max, each rounded up to a multiple of ``4 * world_size`` (fp32, exact splits)."""
    quantum = 4 * world_size
    out: list[int] = []
    s = min_bytes
    while s <= max_bytes:
        r = -(-s // quantum) * quantum
        if not out or r != out[-1]:
            out.append(r)
        s *= 2
    return out


# ---- fingerprint and cache -------------------------------------------------------------------


def fingerprint(device_kind: str, world_size: int, nnodes: int = 1, threads: int | None = None) -> dict:
    """What makes a measurement reusable; ``threads`` defaults to :func:`harness.spec.threads_per_rank` on CPU."""
    cpu = device_kind == "cpu"
    return {
        "device_kind": device_kind,
        "device_name": calibrate.device_name(device_kind),
        "backend": "gloo" if cpu else "nccl",
        "world_size": world_size,
        "nnodes": nnodes,
        "torch": torch.__version__,
        "threads_per_rank": (threads or threads_per_rank(world_size)) if cpu else None,
        "machine": platform.machine(),
    }


def lookup_comm(device_kind: str, world_size: int, nnodes: int = 1, cache: Path | None = None) -> dict | None:
    """The cached comm entry for this machine and rank count, or None."""
    entry = store.get("comm", fingerprint(device_kind, world_size, nnodes), cache)
    # entries from before the synchronisation cost was measured are re-measured, not reused
    return entry if entry is not None and "sync_s" in entry else None


def _covers(entry: dict, min_bytes: int, max_bytes: int) -> bool:
    want = sizes(min_bytes, max_bytes, entry["fingerprint"]["world_size"])
    for rows in entry["collectives"].values():
        if not rows or rows[0]["bytes"] > want[0] or rows[-1]["bytes"] < want[-1]:
            return False
    return set(entry["collectives"]) >= set(COLLECTIVES) and "sync_s" in entry


def store_comm(entry: dict, cache: Path | None = None) -> dict:
    """Keep one measured comm entry in the calibration store; return it as stored."""
    return store.put("comm", entry["fingerprint"], entry, cache)


def calibrate_comm(device_kind: str, world_size: int, min_bytes: int, max_bytes: int, force: bool = False,
                   cache: Path | None = None) -> dict:
    """Measure (or reuse) bus bandwidth on ``world_size`` local ranks; return the cached entry.

    A cached entry is reused only if it covers ``[min_bytes, max_bytes]``. The ranks run under
    torchrun on loopback in a new session; whatever happens, none outlives this call.
    """
    if world_size < 2:
        raise ValueError(f"bus bandwidth needs >= 2 ranks, got world_size {world_size}")
    if not 0 < min_bytes <= max_bytes:
        raise ValueError(f"need 0 < min_bytes ({min_bytes}) <= max_bytes ({max_bytes})")
    if not force:
        hit = lookup_comm(device_kind, world_size, 1, cache)
        if hit is not None and _covers(hit, min_bytes, max_bytes):
            return hit
    expected = fingerprint(device_kind, world_size)
    env = {"OMP_NUM_THREADS": str(expected["threads_per_rank"])} if device_kind == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="harness-comm-") as tmp:
        out, log_path = Path(tmp) / "comm.json", Path(tmp) / "torchrun.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={world_size}",
               "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               f"--rdzv-id=comm-{os.getpid()}", "-m", "harness.calibration.collectives", "--device", device_kind,
               "--out", str(out), "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes)]
        rc = run_job(cmd, log_path, LAUNCH_TIMEOUT_S, env)  # torchrun starts ranks in sessions of their own
        tail = log_path.read_text(errors="replace")[-3000:]
        if rc != 0 or not out.exists():
            how = f"timed out after {LAUNCH_TIMEOUT_S:.0f} s" if rc is None else f"exit {rc}"
            raise RuntimeError(f"comm calibration on {world_size} {device_kind} ranks failed ({how}); output tail:\n{tail}")
        result = json.loads(out.read_text())
    if result["fingerprint"] != expected:
        raise RuntimeError(f"comm calibration ranks measured {result['fingerprint']}, expected {expected}; "
                           "the cache key would not match (is OMP_NUM_THREADS overridden?)")
    return store_comm(result, cache)


# ---- the rank side -----------------------------------------------------------------------------


# torch 2.13 renamed these (same signatures) and deprecates the old names; older torch has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _call(collective: str, nbytes: int, dev: torch.device) -> Callable[[], None]:
    """One call of ``collective`` with nccl-tests message size ``nbytes`` (fp32, zeros: sums stay finite)."""
    n, r = dist.get_world_size(), dist.get_rank()
    numel = nbytes // 4
    full = torch.zeros(numel, device=dev)  # (S/4,)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    if collective == "all_gather":
        shard = torch.zeros(numel // n, device=dev)  # (S/4n,)
        return lambda: _ALL_GATHER(full, shard)
    if collective == "reduce_scatter":
        shard = torch.zeros(numel // n, device=dev)
        return lambda: _REDUCE_SCATTER(shard, full)
    if collective == "all_to_all":
        recv = torch.empty_like(full)
        return lambda: dist.all_to_all_single(recv, full)
    if collective == "send_recv":
        recv = torch.empty_like(full)

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, full, (r + 1) % n), dist.P2POp(dist.irecv, recv, (r - 1) % n)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return ring
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def _max_over_ranks(x: float, dev: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], calls: int, cuda: bool) -> float:
    """Local seconds for ``calls`` calls, device synchronized before the clock is read."""
    _sync(cuda)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(cuda)
    return time.perf_counter() - t0


def measure_collective(collective: str, nbytes: int, max_iters: int, dev: torch.device) -> dict:
    """Warmup, then ``iters`` timed calls; every rank runs the same count (agreed from the warmup's max)."""
    cuda = dev.type == "cuda"
    fn = _call(collective, nbytes, dev)
    warm = _max_over_ranks(_timed(fn, WARMUP_CALLS, cuda) / WARMUP_CALLS, dev)
    iters = max(1, min(max_iters, int(BUDGET_S / max(warm, 1e-9))))
    dist.barrier()
    t = _max_over_ranks(_timed(fn, iters, cuda), dev) / iters
    algbw, busbw = bandwidths(collective, dist.get_world_size(), nbytes, t)
    return {"bytes": nbytes, "time_s": t, "algbw_gbps": algbw, "busbw_gbps": busbw, "iters": iters}


SYNC_BURST_S = 0.002
"""Compute between collectives when measuring the synchronisation cost (a step's typical gap on CPU)."""


def measure_sync_cost(dev: torch.device, calls: int = 30, trials: int = 3) -> float:
    """Extra seconds a collective costs when it follows compute instead of another collective.

    Back-to-back calls find every rank already waiting; in a training step a collective
    follows a burst of compute, so the ranks' communication threads must wake up and the
    ranks meet with some skew. Measured as ``t(compute + all_reduce) - t(compute) - t(all_reduce)``
    at the smallest message (median of ``trials``, the slowest rank's, clipped at 0).
    """
    cuda = dev.type == "cuda"
    a = torch.randn(256, 256, device=dev)
    ar = _call("all_reduce", 4 * dist.get_world_size() * 256, dev)
    reps = 1

    def burst() -> None:
        for _ in range(reps):
            a @ a

    def burst_then_collective() -> None:
        burst()
        ar()

    one = _timed(burst, 5, cuda) / 5  # size the burst to about SYNC_BURST_S
    reps = max(1, int(SYNC_BURST_S / max(one, 1e-9)))
    out = []
    for _ in range(trials):
        dist.barrier()
        compute = _timed(burst, calls, cuda)
        dist.barrier()
        coll = _timed(ar, calls, cuda)
        dist.barrier()
        both = _timed(burst_then_collective, calls, cuda)
        out.append(_max_over_ranks((both - compute - coll) / calls, dev))
    return max(0.0, sorted(out)[len(out) // 2])


def run(min_bytes: int, max_bytes: int, max_iters: int, dev: torch.device) -> dict:
    n = dist.get_world_size()
    todo = sizes(min_bytes, max_bytes, n)
    for c in COLLECTIVES:  # connection setup (NCCL communicators, p2p channels) kept out of every warmup estimate
        _call(c, todo[0], dev)()
    dist.barrier()
    colls = {c: [measure_collective(c, s, max_iters, dev) for s in todo] for c in COLLECTIVES}
    summary = {c: {"peak_busbw_gbps": max(r["busbw_gbps"] for r in rows), "latency_s": rows[0]["time_s"]}
               for c, rows in colls.items()}
    fp = fingerprint(dev.type, n, nnodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), threads=torch.get_num_threads())
    return {"fingerprint": fp, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "collectives": colls,
            "summary": summary, "sync_s": measure_sync_cost(dev)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="harness.calibration.collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON result, written by rank 0")
    ap.add_argument("--min-bytes", required=True, type=parse_size)
    ap.add_argument("--max-bytes", required=True, type=parse_size)
    ap.add_argument("--iters", type=int, default=20,
                    help=f"most timed calls per size (nccl-tests' default -n 20); fewer when they would exceed {BUDGET_S} s")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = run(args.min_bytes, args.max_bytes, args.iters, dev)
        if dist.get_rank() == 0:
            write_json_atomic(args.out, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
