"""Compute time of a rank's step, from a workload calibration (or the matmul peak alone).

The workload calibration (``harness calibrate --workloads SIZE --concurrent K``) times, with a
rank's thread count and K copies running at once (as K ranks of a node compute at once, sharing
cores, caches and memory bandwidth; each time the slowest copy's), a forward+backward pass of the size at 1, 2 and 4 sequences and one AdamW
step, and fits the pass time as ``alpha + rows * beta`` (least squares): ``alpha`` is the
per-pass cost that does not shrink with the batch (kernel launches, Python, small-kernel
inefficiency), ``beta`` the cost per sequence. It is the compute analogue of the latency /
bandwidth (Hockney) model used for collectives. A rank's share of a pass scales ``beta`` by
its share of the model FLOPs (tensor parallel: ``1 / tp``; a pipeline stage: its layers and
head) and ``alpha`` by its share of the layers. The strategy's wrappers cost time of their own
(FSDP2's hooks and parameter copy-in/out, DTensor's Python dispatch): the calibration times one
pass through the real ``apply_fsdp`` / ``apply_tp`` on a one-rank group, where collectives move
nothing, and adds the difference to ``alpha``; the optimizer step scales with the parameters
the rank holds (AdamW is memory-bound: Kingma & Ba 2015, one pass over four fp32 tensors).

Without a workload calibration the model falls back to the roofline bound: ``alpha = 0`` and
``beta`` = FLOPs per sequence / calibrated (or datasheet) matmul peak, and says so.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from harness.measure.stats import fit_line
from harness.model.shape import CellShape

PROBE_ROWS = (1, 2, 4)
WORKLOAD_CALIBRATION_VERSION = 3
"""Bumped when what the workload calibration measures changes, so older cache entries are re-measured."""
GIB = 1024**3


@dataclass(frozen=True)
class ComputeRates:
    """Per-pass cost model of one device (or CPU rank) for one size, dtype and thread count."""

    alpha_s: float
    """Per forward+backward pass, independent of the rows."""
    beta_s_per_row: float
    """Per sequence of the calibrated length, whole model."""
    optimizer_s_per_param: float
    """AdamW step (and zero_grad) per parameter the rank holds."""
    basis: str
    """``workload`` (measured passes) or ``matmul peak`` (roofline bound: no workload calibration)."""
    base_gib: float | None = None
    """Process memory before the model exists (CPU: the RSS of an interpreter with torch loaded)."""
    wrapper_overhead_s: float = 0.0
    """Extra per-pass cost of the strategy's wrappers (FSDP2 hooks, DTensor dispatch), whole model."""


def layer_flops_per_token(c: CellShape) -> float:
    s = c.size
    matmul_params = s.params_per_layer - 4 * s.d_model  # LayerNorm weights do no matmul
    return 6 * matmul_params + 12 * s.d_model * s.seq_len


def head_flops_per_token(c: CellShape) -> float:
    return 6 * c.size.d_model * c.size.vocab_size


def stage_shares(c: CellShape) -> list[tuple[float, float]]:
    """Per pipeline rank: (share of the model FLOPs, share of the layers) it computes."""
    from harness.model.inventory import rank_layers, stages_of_rank

    stages = c.dims.pp * c.virtual
    lf, hf = layer_flops_per_token(c), head_flops_per_token(c)
    total = c.size.n_layers * lf + hf
    out = []
    for p in range(c.dims.pp):
        mine = stages_of_rank(p, c.dims.pp, c.virtual)
        layers = rank_layers(c.size.n_layers, c.dims.pp, c.virtual, p)
        head = stages - 1 in mine
        out.append(((layers * lf + (hf if head else 0)) / total, (layers + (1 if head else 0)) / (c.size.n_layers + 1)))
    return out


def pass_time_s(rates: ComputeRates, rows: float, flop_share: float, layer_share: float, tp: int) -> float:
    """One forward+backward pass of ``rows`` sequences over a rank's share of the model."""
    return (rates.alpha_s + rates.wrapper_overhead_s) * layer_share + rows * rates.beta_s_per_row * flop_share / tp


WRAPPERS = ("fsdp", "tp", "fsdp+tp")


def wrapper_of(c: CellShape) -> str | None:
    """Which calibrated wrapper overhead a cell pays: FSDP2 hooks, DTensor (tp) dispatch, or both."""
    fsdp, tp = c.fsdp, c.dims.tp_enabled
    return "fsdp+tp" if fsdp and tp else "fsdp" if fsdp else "tp" if tp else None


def roofline_rates(c: CellShape, peak_tflops: float, mem_gbps: float | None = None) -> ComputeRates:
    """The bound with no workload calibration: matmul FLOPs at the peak, AdamW at memory bandwidth."""
    flops_per_row = c.size.flops_per_token() * c.size.seq_len
    opt = 28.0 / (mem_gbps * 1e9) if mem_gbps else 0.0  # AdamW reads param, grad, m, v; writes param, m, v (fp32)
    return ComputeRates(alpha_s=0.0, beta_s_per_row=flops_per_row / (peak_tflops * 1e12),
                        optimizer_s_per_param=opt, basis="matmul peak")


# ---- measurement (runs in a child process: `python -m harness calibrate --workloads ...`) ----

def _median_time(fn, reps: int) -> float:
    fn()  # warmup
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _model(size, dev):
    import torch

    from workloads.model import GPT

    torch.manual_seed(0)
    with torch.device(dev):
        return GPT(size)


def _pass(model, plan, device_kind: str, x):
    """A forward+backward of ``model`` on ``x`` (the loss of :mod:`harness.train`), device-synchronised."""
    import torch

    from workloads.model import lm_loss

    def fb() -> None:
        with plan.autocast(device_kind):
            loss = lm_loss(model(x), x)
        loss.backward()
        if device_kind == "cuda":
            torch.cuda.synchronize()

    return fb


def _tokens(size, rows: int, dev):
    import torch

    return torch.randint(0, size.vocab_size, (rows, size.seq_len), generator=torch.Generator().manual_seed(rows)).to(dev)


def _plain_passes(size, plan, device_kind: str, dev, reps: int) -> tuple[list[float], float]:
    """Pass times at ``PROBE_ROWS`` and the AdamW step time; the model is freed on return."""
    import torch

    model = _model(size, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    reps_by_rows = reps
    for rows in PROBE_ROWS:
        times.append(_median_time(_pass(model, plan, device_kind, _tokens(size, rows, dev)), reps_by_rows))
        if times[-1] < 0.2:  # cheap passes: more repeats against this machine's noise
            reps_by_rows = max(reps, 7)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device_kind == "cuda":
            torch.cuda.synchronize()

    return times, _median_time(step, reps)


def measure_workload(size_name: str, seq_len: int, dtype: str, device_kind: str, reps: int = 3) -> dict:
    """Time forward+backward at ``PROBE_ROWS`` sequences and one AdamW step; fit alpha and beta."""
    import torch

    from harness.precision import PrecisionPlan
    from workloads.sizes import get_size

    dev = torch.device("cuda" if device_kind == "cuda" else "cpu")
    base_gib = _worker_base_gib(device_kind)
    size = replace(get_size(size_name), seq_len=seq_len)
    plan = PrecisionPlan(dtype)
    plan.configure_backends(device_kind)
    # one model at a time (each helper frees its own): K concurrent copies of `small` must fit in host memory
    times, opt_s = _plain_passes(size, plan, device_kind, dev, reps)
    alpha, beta = fit_line(list(PROBE_ROWS), times)
    overheads = {w: _wrapped_pass_s(size, plan, device_kind, dev, w, reps) - times[0] for w in WRAPPERS}
    return {"size": size_name, "seq_len": seq_len, "dtype": dtype, "rows": list(PROBE_ROWS), "pass_s": times,
            "alpha_s": alpha, "beta_s_per_row": beta, "optimizer_s": opt_s, "params": size.params,
            "optimizer_s_per_param": opt_s / size.params, "base_gib": base_gib,
            "wrapper_overhead_s": {w: max(0.0, o) for w, o in overheads.items()}}


def _init_one_rank_group(device_kind: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        from harness.launch import free_port

        backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _worker_base_gib(device_kind: str) -> float:
    """Resident memory of a rank before its model exists: the worker's imports and a process group."""
    import psutil

    import harness.worker  # noqa: F401  (what a rank imports)

    _init_one_rank_group(device_kind)
    return psutil.Process().memory_info().rss / GIB


def _wrapped_pass_s(size, plan, device_kind: str, dev, wrapper: str, reps: int) -> float:
    """One-sequence forward+backward through the strategy's real wrappers on a one-rank group.

    Collectives over one rank move nothing, so the difference to the plain pass is the
    wrappers' own cost: FSDP2's hooks and copy-in/out, DTensor's dispatch.
    """
    from harness.parallel.data_parallel import apply_fsdp
    from harness.parallel.dims import ParallelDims
    from harness.parallel.tp import apply_tp

    _init_one_rank_group(device_kind)
    dims = ParallelDims(world_size=1)
    dims.build_mesh(dev.type)
    model = _model(size, dev)
    if "tp" in wrapper:
        apply_tp(model, dims.mesh("tp"), sequence_parallel=False)
    if "fsdp" in wrapper:
        apply_fsdp(model, dims.mesh("dp_shard"), True, plan.fsdp_policy())
    return _median_time(_pass(model, plan, device_kind, _tokens(size, PROBE_ROWS[0], dev)), reps)


def rates_from_entry(entry: dict, wrapper: str | None = None) -> ComputeRates:
    overhead = (entry.get("wrapper_overhead_s") or {}).get(wrapper, 0.0) if wrapper else 0.0
    return ComputeRates(alpha_s=entry["alpha_s"], beta_s_per_row=entry["beta_s_per_row"],
                        optimizer_s_per_param=entry["optimizer_s_per_param"], basis="workload",
                        base_gib=entry.get("base_gib"), wrapper_overhead_s=overhead)


# ---- cache (the calibration file of harness.measure.calibrate, entries of kind "workload") ----

def workload_fingerprint(device_kind: str, size: str, seq_len: int, dtype: str, threads: int,
                         concurrent: int = 1) -> dict:
    from harness.measure.calibrate import device_name

    import torch

    return {"kind": "workload", "version": WORKLOAD_CALIBRATION_VERSION, "device_kind": device_kind,
            "device_name": device_name(device_kind), "size": size, "seq_len": seq_len, "dtype": dtype,
            "threads": threads if device_kind == "cpu" else None, "concurrent": concurrent, "torch": torch.__version__}


def lookup_workload(device_kind: str, size: str, seq_len: int, dtype: str, threads: int, concurrent: int = 1,
                    cache: Path | None = None) -> dict | None:
    from harness.measure import calibrate

    cache = cache or calibrate.default_cache()
    if not cache.exists():
        return None
    key = calibrate._key(workload_fingerprint(device_kind, size, seq_len, dtype, threads, concurrent))
    return json.loads(cache.read_text()).get(key)


def _measure_in_child(args: tuple) -> dict:
    size, seq_len, dtype, device_kind, threads, index = args
    import torch

    if device_kind == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(index)
    return measure_workload(size, seq_len, dtype, device_kind)


def measure_concurrent(size: str, seq_len: int, dtype: str, device_kind: str, threads: int, concurrent: int) -> dict:
    """Run the measurement in ``concurrent`` processes at once, as a node's ranks compute at once.

    CPU ranks share cores, caches and memory bandwidth (GPU ranks share the host): a pass timed
    alone is faster than the same pass beside the other ranks. Each time is the slowest copy's;
    alpha and beta are refitted from those.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(size, seq_len, dtype, device_kind, threads, i) for i in range(concurrent)]
    with ProcessPoolExecutor(max_workers=concurrent, mp_context=mp.get_context("spawn")) as pool:
        runs = list(pool.map(_measure_in_child, jobs))
    out = dict(runs[0])
    out["pass_s"] = [max(r["pass_s"][i] for r in runs) for i in range(len(PROBE_ROWS))]
    out["optimizer_s"] = max(r["optimizer_s"] for r in runs)
    out["optimizer_s_per_param"] = out["optimizer_s"] / out["params"]
    out["wrapper_overhead_s"] = {w: max(r["wrapper_overhead_s"][w] for r in runs) for w in WRAPPERS}
    out["alpha_s"], out["beta_s_per_row"] = fit_line(list(PROBE_ROWS), out["pass_s"])
    out["base_gib"] = max(r["base_gib"] for r in runs)
    return out


def calibrate_workload(device_kind: str, size: str, seq_len: int, dtype: str, threads: int, concurrent: int = 1,
                       cache: Path | None = None, force: bool = False) -> dict:
    """Measure (or reuse) the workload rates and store them in the calibration file."""
    from harness.measure import calibrate
    from harness.results.atomic import write_json_atomic

    cache = cache or calibrate.default_cache()
    if not force:
        hit = lookup_workload(device_kind, size, seq_len, dtype, threads, concurrent, cache)
        if hit is not None:
            return hit
    fp = workload_fingerprint(device_kind, size, seq_len, dtype, threads, concurrent)
    entry = {"kind": "workload", "fingerprint": fp, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             **measure_concurrent(size, seq_len, dtype, device_kind, threads, concurrent)}
    entries = json.loads(cache.read_text()) if cache.exists() else {}
    entries[calibrate._key(fp)] = entry
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache, entries)
    return entry


def threads_for(device_kind: str, local_world: int) -> int:
    """The thread count a rank runs with on CPU (:func:`harness.measure.calibrate.threads_per_rank`); 0 on GPU."""
    from harness.measure.calibrate import threads_per_rank

    return threads_per_rank(local_world) if device_kind == "cpu" else 0
