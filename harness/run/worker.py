"""The per-rank entry point torchrun starts: one cell, measured, gathered, written by rank 0.

``python -m harness.run.worker --cell CELL.json --out CELL_DIR``. Rank 0 writes
``CELL_DIR/result.json`` (atomically); a rank that fails writes ``CELL_DIR/error-rank<r>.json``
with its classified status (``oom`` or ``crashed``) before exiting non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from harness.measure import gns
from harness.measure.comm_counter import CommCounter
from harness.measure.compile_stats import dynamo_counts
from harness.measure.monitor import make_monitor
from harness.measure.nvtx_ranges import PhaseAnnotations, Ranges
from harness.measure.parity_probe import tensor_sq_norms
from harness.measure.phases import PhaseMarks
from harness.measure.rank_memory import model_state_bytes, peak_memory, reset_peak
from harness.measure.step_composition import PHASE_PREFIX, composition_from_frames
from harness.measure.tensor_bytes import holding_tracker
from harness.measure.timer import StepTimer
from harness.measure.trace_analysis import analyse_frames, load_trace
from harness.parallel.cp import CP_LABEL, shard_sequence
from harness.parallel.expert_load import ExpertLoad
from harness.parallel.levers import build_optimizer
from harness.parallel.parallelize import parallelize
from harness.parallel.pipeline import static_shapes
from harness.precision import PrecisionPlan
from harness.records.atomic import write_json_atomic
from harness.records.env import capture
from harness.records.record import clean
from harness.run import train
from harness.run.heartbeat import Heartbeat
from harness.run.record_metrics import worker_metrics
from harness.scaling import lr_at
from harness.spec import CellConfig, threads_per_rank
from harness.units import GIB
from workloads.data import MarkovData
from workloads.model import Decoder, lm_loss

PROFILE_WARMUP = 1  # after the measured window: 1 profiler warmup step + 3 recorded steps
PROFILE_STEPS = 4


def _gather_json(obj, device: torch.device) -> list:
    """All-gather a JSON-serialisable object from every rank (no pickle)."""
    data = torch.tensor(list(json.dumps(clean(obj)).encode()), dtype=torch.uint8, device=device)
    n = torch.tensor([data.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    bufs = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded)
    return [json.loads(bytes(b[: int(s.item())].tolist()).decode()) for b, s in zip(bufs, sizes)]


def _threads_per_rank() -> int:
    return threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _dp_coordinate(dims) -> int:
    """This rank's index along the flattened (dp_replicate, dp_shard) dimensions."""
    rep = dims.mesh("dp_replicate").get_local_rank()
    shard = dims.mesh("dp_shard").get_local_rank()
    return rep * dims.dp_shard + shard


def _apply_mem_cap(cfg: CellConfig) -> None:
    """Cap address-space growth so an over-budget CPU cell fails with MemoryError (status oom)."""
    if cfg.mem_cap_gib is None:
        return
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    cap = vm + int(cfg.mem_cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def run_cell(cfg: CellConfig, out_dir: Path, marks: PhaseMarks | None = None) -> dict | None:
    """Run one cell on the initialised process group; rank 0 returns the result payload.

    ``marks``: the phases this process has already been through (the entry point's); the cell's
    phases are marked on it (:mod:`harness.measure.phases`)."""
    t0 = time.perf_counter()
    marks = marks if marks is not None else PhaseMarks()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"cell needs world size {cfg.world_size}, process group has {world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(_threads_per_rank())
    threads = torch.get_num_threads()

    size = cfg.model_size
    layout = cfg.layout  # validated by the planner (resolve_cell) before the cell was launched
    dims = layout.dims
    dims.build_mesh(device.type)
    precision = PrecisionPlan(cfg.precision)
    precision.configure_backends(cfg.device_kind)

    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = Decoder(size)
    gns_state = None
    if layout.data_parallel == "ddp":
        gns_state = gns.LocalGradNorm(process_group=dims.mesh("dp_replicate").get_group())
    # An MoE's stages are static: runtime shape inference would route an uninitialised tensor on later
    # stages and count its load towards the balancing step.
    shapes = static_shapes(dims, cfg.global_batch // dims.dp // cfg.microbatches, cfg.seq_len,
                           size.d_model, size.vocab_size, precision.autocast_dtype, layout.fsdp) if size.moe else None
    par = parallelize(model, layout, device, precision, cfg.pp_schedule, cfg.microbatches,
                      loss_fn=lm_loss, ddp_comm_hook=gns.local_norm_allreduce_hook if gns_state else None,
                      ddp_comm_state=gns_state, ac=cfg.ac, compiled=cfg.compile, stage_shapes=shapes)
    params = [p for p in par.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optimizer, cfg.lr)
    ranges = Ranges(enabled=cfg.nvtx)
    moe = ExpertLoad(par.parts, size, cfg.moe_routing, cfg.ac, device, ranges, dims.tp) if size.moe else None
    ctx = train.StepContext(par=par, optimizer=optimizer, precision=precision,
                            scaler=precision.grad_scaler(cfg.device_kind), device_kind=cfg.device_kind,
                            grad_accum=1 if par.pipeline else cfg.grad_accum, ranges=ranges, moe=moe)
    marks.mark("build")

    data = MarkovData(size.vocab_size, cfg.seq_len, seed=cfg.seed)
    dp_rank = _dp_coordinate(dims)
    local_batch = cfg.global_batch // dims.dp
    cp_rank = dims.mesh("cp").get_local_rank()

    def batch(step: int):
        with ranges.range("data"):
            x, y = data.batch(step, cfg.global_batch)
            sl = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
            x, y = x[sl], y[sl]
            if dims.cp_enabled:  # this rank's head and tail chunks of each sequence (harness.parallel.cp)
                x, y = shard_sequence(x, cp_rank, dims.cp), shard_sequence(y, cp_rank, dims.cp)
            return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    timer = StepTimer(cfg.device_kind)
    total = cfg.warmup + cfg.steps
    times, losses, skipped, g_big = [], [], 0, []
    probe: dict = {}
    monitor = None
    reset_peak(cfg.device_kind)
    dynamo = {"start": dynamo_counts()} if cfg.compile else {}
    beat = Heartbeat(out_dir, rank)
    for step in range(total):
        if step == cfg.warmup:
            if cfg.compile:
                dynamo["window"] = dynamo_counts()
            marks.mark("warmup")
            monitor = _start_monitor(cfg, local_rank, device)
            beat.open_window()
            ranges.window_start(rank)  # the payload says which process of a shared nsys report is which rank
            if moe is not None:
                moe.window_start()
        x, y = batch(step)
        lr = _lr(cfg, step)
        scale = ctx.scaler.get_scale() if ctx.scaler is not None else 1.0
        with ranges.range("step", payload=step), ranges.train_step(step):
            timer.start()
            loss, was_skipped = train.train_step(ctx, x, y, lr)
            times.append(timer.stop())
        if step >= cfg.warmup:
            beat.beat()
        if step == 0:  # after the clock stopped: the probe's gathers are never timed
            probe = tensor_sq_norms(par.parts)
        skipped += int(was_skipped)
        losses.append(float(loss) if loss is not None else None)
        if gns_state is not None:
            # The hook saw the loss-scaled local gradient; the optimizer step unscaled p.grad in place.
            gns_state.take(scale=scale)
            g_big.append(gns.grad_sq_norm(params) if not was_skipped else float("nan"))
    ranges.window_stop()
    moe_load = {**moe.summary(), "per_step": moe.per_step()} if moe is not None else None
    marks.mark("measured")
    beat.close_window()
    monitor_result = monitor.stop() if monitor is not None else None
    compiled = {"warmup": asdict(dynamo["window"].since(dynamo["start"])),
                "measured": asdict(dynamo_counts().since(dynamo["window"]))} if cfg.compile else None

    # Communication: counted on one extra, untimed step (collectives are the same every step,
    # and a dispatch-mode counter would tax every op of the timed ones).
    counter = CommCounter()
    with counter:
        train.train_step(ctx, *batch(total), _lr(cfg, total))
    comm = counter.per_step(1)
    comm_cp = counter.per_step_labelled(CP_LABEL, 1)
    ep_rows = moe.ep_rows() if moe is not None else None  # its last step is the counted one
    state_bytes = model_state_bytes(par.parts, optimizer)
    mem = peak_memory(cfg.device_kind)
    if cfg.device_kind == "cpu":  # RSS cannot tell a shard from the whole: count tensor bytes on one more step
        mem["peak_tensor_bytes"] = _tensor_peak_bytes(ctx, *batch(total + 1), _lr(cfg, total + 1))

    marks.mark("extra_steps")
    trace_paths, profiled_times = _profile(cfg, ctx, batch, timer, total + 2, out_dir, rank) if cfg.profile \
        else ({}, [])
    if cfg.profile:
        marks.mark("profile")
    local = {
        "rank": rank,
        "times": times,
        "losses": None if all(l is None for l in losses) else losses,
        "g_small": gns_state.history if gns_state else None,
        "mem": mem,
        "state_bytes": state_bytes,
        "comm": comm,
        "comm_cp": comm_cp,
        "moe_ep_rows": ep_rows,
        "trace": trace_paths,
        "profiled_times": profiled_times,
        "probe": probe,
        "dynamo": compiled,
    }
    gathered = _gather_json(local, device if cfg.device_kind == "cuda" else torch.device("cpu"))
    if rank != 0:
        return None
    env = capture(cfg.device_kind)
    if monitor_result is not None:
        monitor_result.save_csv(out_dir / "monitor.csv")
    trace = _analyse_traces(gathered, out_dir)
    marks.mark("result")
    metrics, samples = worker_metrics(cfg, size, dims, precision, layout.data_parallel, gathered, g_big, skipped,
                                      ctx.scaler, data.entropy_floor, local_batch, threads, env["device_name"],
                                      monitor_result, trace, worker_wall_s=time.perf_counter() - t0,
                                      phase_marks=marks.marks, nvtx=ranges.describe(), moe=moe_load)
    return {"metrics": metrics, "samples": samples, "env": env, "degrees": dims.degrees(),
            "workload": {**size.as_dict(), "params": size.params}}


def _tensor_peak_bytes(ctx: train.StepContext, x: torch.Tensor, y: torch.Tensor, lr: float) -> int:
    """Peak bytes of live tensor storages over one untimed step (:class:`TensorBytes`; the tracker
    taxes every op, so never on a timed step): what the CUDA allocator's peak counts on a GPU,
    here for CPU ranks. Parameters, buffers, gradients, optimizer state and DDP's buckets exist
    before the step and are held."""
    tracker = holding_tracker(ctx.par.parts, ctx.par.model, ctx.optimizer)
    with tracker:
        train.train_step(ctx, x, y, lr)
    return tracker.peak_bytes


def _lr(cfg: CellConfig, step: int) -> float:
    return lr_at(step, cfg.lr, cfg.lr_warmup_steps)


def _start_monitor(cfg: CellConfig, local_rank: int, device: torch.device):
    """Node-local rank 0 samples NVML (GPU) or the host (CPU) over the measured window (none at ``--monitor-hz 0``)."""
    if local_rank != 0 or cfg.monitor_hz == 0:
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    indices = list(range(local_world)) if cfg.device_kind == "cuda" else []
    mon = make_monitor(cfg.device_kind, indices, rate_hz=cfg.monitor_hz, pids=_local_pids())
    mon.start()
    return mon


def _local_pids() -> list[int]:
    """This node's rank processes: the siblings its launcher started (same parent: torchrun's ranks run
    ``harness.run.worker``, forked ones keep the fork server's command line)."""
    me = psutil.Process()
    parent = me.parent()
    if parent is None:
        return [me.pid]
    return [c.pid for c in parent.children()
            if any(m in " ".join(c.cmdline()) for m in ("harness.run.worker", "harness.run.fork_server"))] or [me.pid]


def _profile(cfg: CellConfig, ctx, batch, timer: StepTimer, first_step: int, out_dir: Path,
             rank: int) -> tuple[dict, list[float]]:
    """Extra steps after the measured window under torch.profiler, so profiling never taxes timed steps.

    Returns this rank's trace path and the step timer's time of each recorded step (data included,
    as in the profiler's ProfilerStep#N window), against which the step composition is checked."""
    trace_dir = out_dir / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    ranks = set(cfg.profile_ranks) if cfg.profile_ranks else set(range(cfg.world_size))
    active = rank in ranks
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device_kind == "cuda" else [])
    prof = profile(activities=acts, schedule=schedule(wait=0, warmup=PROFILE_WARMUP, active=PROFILE_STEPS - PROFILE_WARMUP),
                   on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}", use_gzip=True)) \
        if active else None
    if prof is not None:
        prof.start()
    # harness:<phase> profiler annotations in these steps only: the step composition reads them.
    annotated = replace(ctx, ranges=PhaseAnnotations(ctx.ranges))
    times = []
    for i in range(PROFILE_STEPS):
        timer.start()
        with record_function(f"{PHASE_PREFIX}data"):
            x, y = batch(first_step + i)
        train.train_step(annotated, x, y, _lr(cfg, first_step + i))
        times.append(timer.stop())
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    dist.barrier()
    if not active:
        return {}, []
    return ({str(rank): str(p) for p in sorted(trace_dir.glob(f"rank{rank}.*.json.gz"))[-1:]},
            times[PROFILE_WARMUP:])


def _analyse_traces(gathered: list[dict], out_dir: Path) -> dict | None:
    """The profiler traces' aggregate (``metrics.trace``), with the per-rank table beside the result."""
    traces = {int(k): Path(v) for g in gathered for k, v in g["trace"].items()}
    if not traces:
        return None
    frames = {rank: load_trace(path) for rank, path in sorted(traces.items())}  # each trace read once
    df, agg = analyse_frames(frames)
    df.to_csv(out_dir / "trace_ranks.csv", index=False)
    if agg["steps"]:  # else agg["reason"] says why there is no per-step split
        timed = {int(g["rank"]): g["profiled_times"] for g in gathered if g["profiled_times"]}
        agg.update(composition_from_frames(frames, timed))
    return agg


def _classify(exc: BaseException) -> str:
    if isinstance(exc, MemoryError) or isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom"
    text = str(exc)
    if "can't allocate memory" in text or "out of memory" in text.lower():
        return "oom"
    return "crashed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="harness.run.worker")
    ap.add_argument("--cell", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    marks = PhaseMarks.of_this_process()  # every module is imported by now
    cfg = CellConfig.from_dict(json.loads(args.cell.read_text()))
    rank = int(os.environ.get("RANK", "0"))
    try:
        _apply_mem_cap(cfg)
        backend = "nccl" if cfg.device_kind == "cuda" else "gloo"
        if cfg.device_kind == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        marks.mark("process_group")
        result = run_cell(cfg, args.out, marks)
        if result is not None:
            write_json_atomic(args.out / "result.json", clean(result))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # classify, record for the launcher, and still fail loudly
        status = _classify(exc)
        tb = traceback.format_exc()
        write_json_atomic(args.out / f"error-rank{rank}.json",
                          {"rank": rank, "status": status, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-8000:]})
        print(tb, file=sys.stderr, flush=True)
        return 3 if status == "oom" else 1


def exit_now(code: int) -> None:
    """End the process without Python's finalization (~0.7 s after importing torch, per process): every
    result is already written and flushed to disk, and nothing registered at exit is needed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
