"""Workload calibration: a size's forward+backward and AdamW step timed on this machine.

What :mod:`harness.model.compute` fits its per-pass cost model to (the docstring there has the
model). Timed with a rank's thread count and K copies running at once, as K ranks of a node
compute at once (sharing cores, caches and memory bandwidth); each time is the slowest copy's.
The K copies run in lockstep: each waits for the others at a barrier before every timed pass, as
the ranks of a data-parallel cell meet at every step's collectives; unsynchronised copies could
time their passes while another copy was still importing torch. (On a shared 2-core machine the
passes stay noisy: two lockstep calibrations of ``mini`` minutes apart differed by up to 39% at
one probe.)
Runs in a child process (``python -m harness calibrate --workloads ...``); the entries live in
the calibration store (:mod:`harness.calibration.store`) as kind ``workload``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from harness.calibration import steadiness, store
from harness.calibration.matmul import device_name
from harness.calibration.provenance import label_of
from harness.errors import UsageError
from harness.jobs import free_port
from harness.measure.step_stats import fit_line
from harness.model.compute import WRAPPERS
from harness.model.memory import peak_bytes
from harness.model.predict import CPU_BASE_GIB
from harness.model.shape import CellShape
from harness.parallel.dims import ParallelDims
from harness.parallel.levers import apply_compile
from harness.precision import PrecisionPlan
from harness.units import GIB
from workloads.model import Decoder, lm_loss
from workloads.sizes import ModelSize

PROBE_ROWS = (1, 2, 4, 8)  # up to the local batch of a default 8-sequence single-device cell
WORKLOAD_CALIBRATION_VERSION = 7  # 4: the tp-sp wrapper; 5: the wrappers' AdamW cost; 6: 8 rows; 7: lockstep
"""Bumped when what the workload calibration measures changes, so older cache entries are re-measured."""
REPS = 5
"""Timed repeats of every probe (the median is kept, all are stored with their spread: see
:mod:`harness.calibration.steadiness`). The same count in every copy: lockstep copies must meet at
the barrier equally often."""
FIRST_PROBE_WARMUP = 2
"""Untimed passes before a model's first probe (1 before the others): with one, the first timed
repeat of a freshly built model's first pass ran slower than the other four on a quiet machine
(docs/running.md, "Steady calibrations"), the model warming up, not the machine's noise."""
BARRIER_TIMEOUT_S = 600.0
"""How long a copy waits for the others at the barrier before the calibration fails."""
RANK_IMPORTS = ("torch.distributed", "harness.parallel.parallelize", "harness.measure.monitor",
                "harness.measure.nvtx_ranges", "harness.measure.comm_counter", "harness.measure.gns", "workloads.model")
"""What a rank imports before its model exists (``harness.run.worker``'s heavy imports): the base
memory is measured after these, without importing the run layer from below."""


_lockstep = None
"""The barrier the concurrent copies share (set in each copy by :func:`_join_lockstep`), or None alone."""


def _join_lockstep(barrier) -> None:
    global _lockstep
    _lockstep = barrier


def _meet() -> None:
    if _lockstep is not None:
        _lockstep.wait(BARRIER_TIMEOUT_S)


def _timed_repeats(fn, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones, in lockstep."""
    _meet()
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        _meet()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def pass_probe(rows: int, wrapper: str | None = None) -> str:
    """The name a forward+backward probe's repeats are stored under: ``pass 1 row``, ``fsdp pass 1 row``."""
    return f"{wrapper + ' ' if wrapper else ''}pass {rows} row{'s' if rows > 1 else ''}"


def optimizer_probe(wrapper: str | None = None) -> str:
    return f"{wrapper + ' ' if wrapper else ''}AdamW step"


def probe_order(entry: dict) -> list[tuple[str, str]]:
    """``(fast, slow)`` probes of a workload entry where ``slow`` cannot be faster: a pass at more
    rows than another, a wrapped pass or AdamW step than the plain one (the wrappers only add)."""
    rows = entry.get("rows") or list(PROBE_ROWS)
    pairs = [(pass_probe(a), pass_probe(b)) for a, b in zip(rows, rows[1:])]
    measured = entry.get("repeats") or {}
    for w in (w for w in WRAPPERS if pass_probe(rows[0], w) in measured or not measured):
        pairs += [(pass_probe(rows[0]), pass_probe(rows[0], w)), (optimizer_probe(), optimizer_probe(w))]
    return pairs


def judge_entry(entry: dict) -> str | None:
    """Why a measured workload entry is unsteady (:func:`harness.calibration.steadiness.judge`), or None."""
    return steadiness.judge(entry.get("repeats"), probe_order(entry))


def _model(size, dev):
    torch.manual_seed(0)
    with torch.device(dev):
        return Decoder(size)


def _pass(model, plan, device_kind: str, x):
    """A forward+backward of ``model`` on ``x`` (the loss of :mod:`harness.run.train`), device-synchronised."""
    def fb() -> None:
        with plan.autocast(device_kind):
            loss = lm_loss(model(x), x)
        loss.backward()
        if device_kind == "cuda":
            torch.cuda.synchronize()

    return fb


def _tokens(size, rows: int, dev):
    return torch.randint(0, size.vocab_size, (rows, size.seq_len), generator=torch.Generator().manual_seed(rows)).to(dev)


def _plain_passes(size, plan, device_kind: str, dev, reps: int, compiled: bool) -> dict[str, list[float]]:
    """Repeats of the passes at ``PROBE_ROWS`` and of the AdamW step, by probe name; the model is freed on return.

    ``compiled``: each block's forward goes through ``torch.compile`` as a ``--compile on`` cell's
    does; each probe's untimed warmup pass takes the (re)compilation for its batch shape."""
    model = _model(size, dev)
    if compiled:
        apply_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = {pass_probe(rows): _timed_repeats(_pass(model, plan, device_kind, _tokens(size, rows, dev)), reps,
                                            FIRST_PROBE_WARMUP if rows == PROBE_ROWS[0] else 1)
           for rows in PROBE_ROWS}
    out[optimizer_probe()] = _timed_repeats(_optimizer_step(opt, device_kind), reps)
    return out


def _optimizer_step(opt: torch.optim.Optimizer, device_kind: str):
    """One AdamW step (and zero_grad keeping the gradients, so that every call steps), synchronised."""
    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device_kind == "cuda":
            torch.cuda.synchronize()

    return step


def measure_workload(workload: ModelSize, seq_len: int, dtype: str, device_kind: str, reps: int = REPS,
                     compiled: bool = False) -> dict:
    """Time forward+backward of ``workload`` at ``PROBE_ROWS`` sequences and one AdamW step; fit alpha and beta."""
    dev = torch.device("cuda" if device_kind == "cuda" else "cpu")
    base_gib = _worker_base_gib(device_kind)
    size = replace(workload, seq_len=seq_len)
    plan = PrecisionPlan(dtype)
    plan.configure_backends(device_kind)
    # one model at a time (each helper frees its own): K concurrent copies of `small` must fit in host memory
    repeats = _plain_passes(size, plan, device_kind, dev, reps, compiled)
    for w in wrappers_of(size):
        repeats.update(_wrapped_repeats(size, plan, device_kind, dev, w, reps, compiled))
    return {"size": workload.key, "seq_len": seq_len, "dtype": dtype, "rows": list(PROBE_ROWS), "params": size.params,
            "base_gib": base_gib, **from_repeats(repeats, size.params)}


def from_repeats(repeats: dict[str, list[float]], params: int) -> dict:
    """The entry's timings from its probes' repeats: each probe's median, alpha and beta fitted to the
    passes, and the wrappers' extra cost over the plain pass and AdamW step (clipped at 0)."""
    med = {name: statistics.median(ts) for name, ts in repeats.items()}
    times = [med[pass_probe(r)] for r in PROBE_ROWS]
    opt_s = med[optimizer_probe()]
    alpha, beta = fit_line(list(PROBE_ROWS), times)
    return {"pass_s": times, "alpha_s": alpha, "beta_s_per_row": beta, "optimizer_s": opt_s,
            "optimizer_s_per_param": opt_s / params, "repeats": repeats,
            "wrapper_overhead_s": {w: max(0.0, med[pass_probe(PROBE_ROWS[0], w)] - times[0]) for w in WRAPPERS
                                   if pass_probe(PROBE_ROWS[0], w) in med},
            "wrapper_optimizer_s": {w: max(0.0, med[optimizer_probe(w)] - opt_s) for w in WRAPPERS
                                    if optimizer_probe(w) in med}}


def wrappers_of(size) -> tuple[str, ...]:
    """The wrappers a size's cells can run under: an MoE has no tensor-parallel plan (planner refuses tp)."""
    return tuple(w for w in WRAPPERS if size.moe is None or "tp" not in w)


def _init_one_rank_group(device_kind: str) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _worker_base_gib(device_kind: str) -> float:
    """Resident memory of a rank before its model exists: the worker's imports and a process group."""
    for name in RANK_IMPORTS:
        importlib.import_module(name)
    _init_one_rank_group(device_kind)
    return psutil.Process().memory_info().rss / GIB


def _wrapped_repeats(size, plan, device_kind: str, dev, wrapper: str, reps: int,
                     compiled: bool) -> dict[str, list[float]]:
    """Repeats of a one-sequence forward+backward, and of one AdamW step, through the strategy's real
    wrappers on a one-rank group, by probe name (``fsdp pass 1 row``, ``fsdp AdamW step``).

    Collectives over one rank move nothing, so the difference to the plain pass is the
    wrappers' own cost: FSDP2's hooks and copy-in/out, DTensor's dispatch. The optimizer's
    difference is DTensor's dispatch of AdamW over DTensor parameters: a cost per parameter
    tensor, which every rank pays whatever the shard size.
    """
    # The wrappers' modules pull in DTensor and FSDP (seconds of imports): the calibration child needs
    # them, the planning parent that imports this module for its lookups does not.
    from harness.parallel.data_parallel import apply_fsdp  # noqa: PLC0415
    from harness.parallel.tp import apply_tp, reduce_partial_grads  # noqa: PLC0415

    _init_one_rank_group(device_kind)
    dims = ParallelDims(world_size=1)
    dims.build_mesh(dev.type)
    model = _model(size, dev)
    if "tp" in wrapper:
        apply_tp(model, dims.mesh("tp"), sequence_parallel=wrapper.endswith("-sp"))
    if compiled:  # in the cell's order: TP, then compile, then FSDP (harness.parallel.parallelize)
        apply_compile(model)
    if "fsdp" in wrapper:
        apply_fsdp(model, dims.mesh("dp_shard"), True, plan.fsdp_policy())
    passes = _timed_repeats(_pass(model, plan, device_kind, _tokens(size, PROBE_ROWS[0], dev)), reps,
                            FIRST_PROBE_WARMUP)
    reduce_partial_grads(model.parameters())  # as the step does before its optimizer (tp-sp's LayerNorms)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {pass_probe(PROBE_ROWS[0], wrapper): passes,
            optimizer_probe(wrapper): _timed_repeats(_optimizer_step(opt, device_kind), reps)}


def workload_fingerprint(device_kind: str, size: str, seq_len: int, dtype: str, threads: int,
                         concurrent: int = 1, compiled: bool = False) -> dict:
    """What makes a workload entry reusable; ``compile`` appears only when on, so eager keys stay put."""
    fp = {"kind": "workload", "version": WORKLOAD_CALIBRATION_VERSION, "device_kind": device_kind,
          "device_name": device_name(device_kind), "size": size, "seq_len": seq_len, "dtype": dtype,
          "threads": threads if device_kind == "cpu" else None, "concurrent": concurrent, "torch": torch.__version__}
    return {**fp, "compile": True} if compiled else fp


def lookup_workload(device_kind: str, size: str, seq_len: int, dtype: str, threads: int, concurrent: int = 1,
                    cache: Path | None = None, compiled: bool = False) -> dict | None:
    fp = workload_fingerprint(device_kind, size, seq_len, dtype, threads, concurrent, compiled)
    return store.get("workload", fp, cache)


def _measure_in_child(args: tuple) -> dict:
    size, seq_len, dtype, device_kind, threads, index, compiled = args
    if device_kind == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(index)
    return measure_workload(size, seq_len, dtype, device_kind, compiled=compiled)


def measure_concurrent(size: ModelSize, seq_len: int, dtype: str, device_kind: str, threads: int, concurrent: int,
                       compiled: bool = False) -> dict:
    """Run the measurement in ``concurrent`` processes at once, as a node's ranks compute at once.

    CPU ranks share cores, caches and memory bandwidth (GPU ranks share the host): a pass timed
    alone is faster than the same pass beside the other ranks. The copies time every pass in
    lockstep (a barrier before each), as ranks that meet at every step's collectives, so each
    repeat's time is the slowest copy's in that repeat; medians, alpha and beta come from those.
    """
    jobs = [(size, seq_len, dtype, device_kind, threads, i, compiled) for i in range(concurrent)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(concurrent) if concurrent > 1 else None
    with ProcessPoolExecutor(max_workers=concurrent, mp_context=ctx, initializer=_join_lockstep,
                             initargs=(barrier,)) as pool:
        runs = list(pool.map(_measure_in_child, jobs))
    return {**runs[0], **from_repeats(slowest_copy(runs), runs[0]["params"]),
            "base_gib": max(r["base_gib"] for r in runs)}


def slowest_copy(runs: list[dict]) -> dict[str, list[float]]:
    """Each probe's repeats, repeat by repeat the slowest copy's (lockstep copies time repeat i together)."""
    return {name: [max(ts) for ts in zip(*(r["repeats"][name] for r in runs))] for name in runs[0]["repeats"]}


def need_gib(size: ModelSize, seq_len: int, dtype: str, device_kind: str, concurrent: int) -> float:
    """The model's peak for the calibration's largest pass, times the copies sharing one memory.

    Each copy is a one-device model at ``max(PROBE_ROWS)`` sequences (the wrapped passes use
    fewer); CPU copies share the host's RAM, GPU copies run one per device.
    """
    shape = CellShape(size=replace(size, seq_len=seq_len), dims=ParallelDims(world_size=1),
                      strategy="single", precision=dtype, global_batch=max(PROBE_ROWS), device_kind=device_kind)
    base = CPU_BASE_GIB * GIB if device_kind == "cpu" else 0.0
    return peak_bytes(shape, base) / GIB * (concurrent if device_kind == "cpu" else 1)


def available_gib(device_kind: str) -> float:
    """Memory the calibration may use now: host RAM available, or the first GPU's free memory."""
    if device_kind == "cuda":
        return torch.cuda.mem_get_info(0)[0] / GIB
    return psutil.virtual_memory().available / GIB


def check_fits(size: ModelSize, seq_len: int, dtype: str, device_kind: str, concurrent: int) -> None:
    """Refuse, before anything is allocated, a workload calibration the memory cannot hold."""
    need, have = need_gib(size, seq_len, dtype, device_kind, concurrent), available_gib(device_kind)
    if need > have:
        raise UsageError(f"workload calibration of {size.key} (seq {seq_len}, {dtype}, {concurrent} cop"
                         f"{'ies' if concurrent > 1 else 'y'}) needs ~{need:.3g} GiB, {have:.3g} GiB is available; "
                         f"its cells are predicted from the matmul peak instead")


def calibrate_workload(device_kind: str, size: ModelSize, seq_len: int, dtype: str, threads: int, *, concurrent: int = 1,
                       cache: Path | None = None, force: bool = False, compiled: bool = False) -> dict:
    """Measure (or reuse) the workload rates and keep them in the calibration store.

    Measured again once when its repeats disagree, stored marked ``unsteady`` when they still do
    (:func:`harness.calibration.steadiness.measure_steadily`)."""
    if not force:
        hit = lookup_workload(device_kind, size.key, seq_len, dtype, threads, concurrent, cache, compiled)
        if hit is not None:
            return hit
    check_fits(size, seq_len, dtype, device_kind, concurrent)
    fp = workload_fingerprint(device_kind, size.key, seq_len, dtype, threads, concurrent, compiled)

    def measure() -> dict:
        return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **measure_concurrent(size, seq_len, dtype, device_kind, threads, concurrent, compiled)}

    entry = steadiness.measure_steadily(measure, label_of("workload", fp), judge_entry)
    return store.put("workload", fp, entry, cache)
