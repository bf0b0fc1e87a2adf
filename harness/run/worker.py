"""The per-rank entry point torchrun starts: one cell, measured, gathered, written by rank 0.

``python -m harness.run.worker --cell CELL.json --out CELL_DIR``. Rank 0 writes
``CELL_DIR/result.json`` (atomically); a rank that fails writes ``CELL_DIR/error-rank<r>.json``
with its classified status (``oom`` or ``crashed``) before exiting non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from harness.measure import gns
from harness.measure.comm_counter import CommCounter
from harness.measure.compile_stats import dynamo_counts, frames_so_far
from harness.measure.monitor import make_monitor
from harness.measure.op_tally import OpTally
from harness.measure.parity_probe import tensor_sq_norms
from harness.measure.phases import PhaseMarks
from harness.measure.rank_memory import model_state_bytes, peak_memory, reset_peak
from harness.measure.tensor_bytes import holding_tracker
from harness.measure.timer import StepTimer
from harness.parallel.activation_checkpoint import MATMULS
from harness.parallel.cp import CP_LABEL
from harness.precision import fp8_observed
from harness.records.atomic import write_json_atomic
from harness.records.env import capture
from harness.records.record import clean
from harness.run import train
from harness.run.cell_build import Batches, BuiltCell, Placement, build_cell, place
from harness.run.heartbeat import Heartbeat
from harness.run.measurement import CellRun, RankMeasurement
from harness.run.profiled_steps import analyse_traces, profile_steps
from harness.run.record_metrics import worker_metrics
from harness.run.resume import Progress, Start, against_source, start_metrics, write_curve
from harness.spec import CellConfig
from harness.units import GIB

if TYPE_CHECKING:
    from harness.run.checkpoint import Checkpointer

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


def _apply_mem_cap(cfg: CellConfig) -> None:
    """Cap address-space growth so an over-budget CPU cell fails with MemoryError (status oom)."""
    if cfg.mem_cap_gib is None:
        return
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    cap = vm + int(cfg.mem_cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def run_cell(cfg: CellConfig, out_dir: Path, marks: PhaseMarks | None = None) -> dict | None:
    """Run one cell on the initialised process group; rank 0 returns the result payload.

    Named steps: place the rank, build the cell, measure its window (warmup, then the measured steps), the extra
    untimed steps (comm count, tensor bytes, the profiler), gather every rank's :class:`RankMeasurement`, and on
    rank 0 summarise them. ``marks``: the phases this process has already been through (the entry point's); the
    cell's phases are marked on it (:mod:`harness.measure.phases`)."""
    t0 = time.perf_counter()
    marks = marks if marks is not None else PhaseMarks()
    where = place(cfg)
    cell = build_cell(cfg, where.device)
    marks.mark("build")
    ckpt, start = _start(cfg, cell, out_dir)
    batches = Batches(cfg, cell, where.device, offset=start.offset)
    window = _measure(cfg, cell, batches, out_dir, where, marks, ckpt=ckpt, start=start)
    if ckpt is not None:  # untimed, like the extra steps (its phase: theirs)
        ckpt.restore_check(cell.ctx, batches, window.losses, cfg.warmup + cfg.steps - 1)
        ckpt.finish(cfg.checkpoint_keep)
    local = _extra_steps(cfg, cell, batches, window, out_dir, where, marks)
    if ckpt is not None or start.kind != "fresh":
        log = ckpt.log.to_json() if ckpt is not None else {"mode": "off", "every": 0, "saves": []}
        local = replace(local, checkpoint={**log, "start": start_metrics(start, window.times, window.resumed_at,
                                                                          window.end)})
    gathered = [RankMeasurement.from_json(g) for g in _gather_json(local.to_json(), where.device)]
    if where.rank != 0:
        return None
    env = capture(cfg.device_kind)
    if window.monitor is not None:
        window.monitor.save_csv(out_dir / "monitor.csv")
    trace = analyse_traces(gathered, out_dir)
    marks.mark("result")
    run = CellRun(g_big=window.g_big, skipped=window.skipped,
                  final_scale=cell.ctx.scaler.get_scale() if cell.ctx.scaler is not None else None,
                  entropy_floor=batches.data.entropy_floor, threads=where.threads, device_name=env["device_name"],
                  monitor=window.monitor, trace=trace, worker_wall_s=time.perf_counter() - t0,
                  phase_marks=marks.marks, nvtx=cell.ranges.describe(), moe=window.moe_load)
    metrics, samples = worker_metrics(cfg, gathered, run)
    if cfg.checkpoint_keep:
        write_curve(out_dir / "checkpoints", metrics["loss"])
    if start.kind == "restore":
        metrics["checkpoint"]["start"].update(against_source(start, metrics["loss"]))
    return {"metrics": metrics, "samples": samples, "env": env, "degrees": cell.dims.degrees(),
            "workload": {**cell.size.as_dict(), "params": cell.size.params}}


@dataclass
class Window:
    """What the warmup and measured steps left on this rank."""

    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    step_parts: list[dict[str, float]] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    skipped: int = 0
    g_big: list[float] = field(default_factory=list)
    probe: dict = field(default_factory=dict)
    monitor: Any = None
    dynamo: dict | None = None
    moe_load: dict | None = None
    frames_compiled: int = 0
    """Frames dynamo compiled over this attempt's steps (any cell: a compile claim's evidence)."""
    resumed_at: float = 0.0
    end: float = 0.0
    """When the first step this attempt ran began, and the measured window ended (seconds since the epoch)."""

    @classmethod
    def resumed(cls, progress: Progress | None) -> Window:
        """Empty, or holding what an earlier attempt measured up to the save this one resumes from."""
        if progress is None:
            return cls()
        return cls(times=progress.times[:], cpu_times=progress.cpu_times[:], losses=progress.losses[:],
                   probe=progress.probe)

    @property
    def total(self) -> int:
        """Steps run so far: the extra steps continue the data stream from here."""
        return len(self.times)


def _start(cfg: CellConfig, cell: BuiltCell, out_dir: Path) -> tuple[Checkpointer | None, Start]:
    """``--checkpoint``, ``--restore-from`` or an earlier attempt's save: the cell's checkpointer and where it starts
    (:func:`harness.run.checkpoint.start_cell`); a cell without either starts at step 0, DCP never imported."""
    if cfg.checkpoint == "off" and cfg.restore_from is None:
        return None, Start()
    from harness.run.checkpoint import start_cell  # noqa: PLC0415 (heavy: DCP, only for a cell that checkpoints)

    return start_cell(cfg, cell.ctx.par.parts, cell.ctx.optimizer, out_dir, cell.ctx.scaler)


def _measure(cfg: CellConfig, cell: BuiltCell, batches: Batches, out_dir: Path, where: Placement,
             marks: PhaseMarks, ckpt: Checkpointer | None = None, start: Start | None = None) -> Window:
    """Warmup steps, then the measured ones: each step timed alone, the monitor, NVTX window and heartbeat
    around the measured ones only; step 1's norms probed after its clock stopped; with ``ckpt`` a save after every
    ``--checkpoint-every`` measured steps, outside the step's clock (its blocking seconds are the save's own). A cell
    resumed from its own save (``start``) runs the steps after it, those before it the earlier attempt's."""
    start = start or Start()
    ctx, ranges, moe, w = cell.ctx, cell.ranges, cell.moe, Window.resumed(start.progress if start.first_step else None)
    timer = StepTimer(cfg.device_kind)
    reset_peak(cfg.device_kind)
    dynamo = {"start": dynamo_counts()} if cfg.compile else {}
    frames0 = frames_so_far()
    beat = Heartbeat(out_dir, where.rank)
    w.resumed_at = time.time()
    for step in range(start.first_step, cfg.warmup + cfg.steps):
        if step == max(cfg.warmup, start.first_step):
            if cfg.compile:
                dynamo["window"] = dynamo_counts()
            marks.mark("warmup")
            w.monitor = _start_monitor(cfg, where.local_rank, where.device)
            beat.open_window()
            ranges.window_start(where.rank)  # the payload says which process of a shared nsys report is which rank
            if moe is not None:
                moe.window_start()
        x, y = batches(step)
        scale = ctx.scaler.get_scale() if ctx.scaler is not None else 1.0
        with ranges.range("step", payload=step), ranges.train_step(step):
            cpu0 = time.process_time()  # outside the timer: the timed step is the step alone
            timer.start()
            loss, was_skipped = train.train_step(ctx, x, y, batches.lr(step))
            w.times.append(timer.stop())
            w.cpu_times.append(time.process_time() - cpu0)
        if w.monitor is not None:  # the host sampler's read, between steps (the NVML sampler's thread: a no-op)
            w.monitor.tick()
        if ctx.par.step_parts is not None:
            w.step_parts.append(ctx.par.step_parts())
        if step >= cfg.warmup:
            beat.beat()
        if step == 0:  # after the clock stopped: the probe's gathers are never timed
            w.probe = tensor_sq_norms(ctx.par.parts)
        w.skipped += int(was_skipped)
        w.losses.append(float(loss) if loss is not None else None)
        if ckpt is not None and step >= cfg.warmup and ckpt.due(step - cfg.warmup + 1):
            with ranges.range("checkpoint", payload=step):
                ckpt.save(step, Progress(step, cfg.to_dict(), w.times[:], w.cpu_times[:], w.losses[:], w.probe,
                                         start.attempts_now()))
        if cell.gns_state is not None:
            # The hook saw the loss-scaled local gradient; the optimizer step unscaled p.grad in place.
            cell.gns_state.take(scale=scale)
            w.g_big.append(gns.grad_sq_norm(cell.params) if not was_skipped else float("nan"))
    w.end = time.time()
    w.frames_compiled = frames_so_far() - frames0
    ranges.window_stop()
    w.moe_load = {**moe.summary(), "per_step": moe.per_step()} if moe is not None else None
    marks.mark("measured")
    beat.close_window()
    w.monitor = w.monitor.stop() if w.monitor is not None else None
    w.dynamo = {"warmup": asdict(dynamo["window"].since(dynamo["start"])),
                "measured": asdict(dynamo_counts().since(dynamo["window"]))} if cfg.compile else None
    return w


def _extra_steps(cfg: CellConfig, cell: BuiltCell, batches: Batches, w: Window, out_dir: Path, where: Placement,
                 marks: PhaseMarks) -> RankMeasurement:
    """Untimed steps after the window (what would tax a timed one), and this rank's measurement of the cell.

    Communication is counted on one extra step (collectives are the same every step, and a dispatch-mode counter
    would tax every op of the timed ones); on CPU the live tensor bytes on one more; ``--profile`` last."""
    ctx, total = cell.ctx, w.total
    counter, tally = CommCounter(), OpTally(MATMULS, ctx.par.parts)
    with counter, (tally if cfg.ac == "none" else contextlib.nullcontext()):
        train.train_step(ctx, *batches(total), batches.lr(total))
    ep_rows = cell.moe.ep_rows() if cell.moe is not None else None  # its last step is the counted one
    mem = peak_memory(cfg.device_kind)
    if cfg.device_kind == "cpu":  # RSS cannot tell a shard from the whole: count tensor bytes on one more step
        mem["peak_tensor_bytes"] = _tensor_peak_bytes(ctx, *batches(total + 1), batches.lr(total + 1))
    if cfg.ac != "none":
        _recompute_step(ctx, tally, batches, total + 2)
    marks.mark("extra_steps")
    trace_paths, profiled = profile_steps(cfg, ctx, batches, total + 3, out_dir, where.rank) if cfg.profile else ({}, [])
    if cfg.profile:
        marks.mark("profile")
    return RankMeasurement(
        rank=where.rank, times=w.times, cpu_times=w.cpu_times if cfg.device_kind == "cpu" else None, losses=[x for x in w.losses if x is not None] or None,
        g_small=cell.gns_state.history if cell.gns_state else None, mem=mem,
        state_bytes=model_state_bytes(ctx.par.parts, ctx.optimizer), comm=counter.per_step(1),
        comm_cp=counter.per_step_labelled(CP_LABEL, 1), moe_ep_rows=ep_rows, trace=trace_paths,
        profiled_times=profiled, probe=w.probe, dynamo=w.dynamo, fp8_linears=ctx.par.fp8_linears,
        observed=_observed(tally, cell, w),
        step_parts=w.step_parts if w.step_parts and cfg.device_kind == "cpu" else None)


def _recompute_step(ctx: train.StepContext, tally: OpTally, batches: Batches, step: int) -> None:
    """One more untimed step under ``tally`` for a checkpointing cell, with torch's early stop off: a checkpointed
    region's recomputation then runs every op its policy recomputes (by default it stops once the last tensor the
    backward needs is back, so a block's trailing matmul whose inputs alone are saved is never run again), and the
    matmuls counted are the policy's exactly. The collectives are counted on the step before, as the cell runs."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), tally:
        train.train_step(ctx, *batches(step), batches.lr(step))


def _observed(tally: OpTally, cell: BuiltCell, w: Window) -> dict[str, Any]:
    """The claims' evidence from this rank (:mod:`harness.run.claims` judges it): the counted step's matmuls and
    watched ops (:class:`OpTally`), the frames dynamo compiled in this cell's steps, the float8 linears' configs, the
    parameters of the model as built."""
    return {"ops": tally.tally.to_json(), "frames_compiled": w.frames_compiled,
            "fp8": fp8_observed(cell.ctx.par.parts), "params_built": cell.built_params}


def _tensor_peak_bytes(ctx: train.StepContext, x: torch.Tensor, y: torch.Tensor, lr: float) -> int:
    """Peak bytes of live tensor storages over one untimed step (:class:`TensorBytes`; the tracker
    taxes every op, so never on a timed step): what the CUDA allocator's peak counts on a GPU,
    here for CPU ranks. Parameters, buffers, gradients, optimizer state and DDP's buckets exist
    before the step and are held."""
    tracker = holding_tracker(ctx.par.parts, ctx.par.model, ctx.optimizer)
    with tracker:
        train.train_step(ctx, x, y, lr)
    return tracker.peak_bytes


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
