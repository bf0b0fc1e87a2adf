"""Every per-step cost of the harness's measured loop, in microseconds, each measured alone on this machine.

    .venv/bin/python scripts/step_costs.py --out results/reference/harness-cost/step-costs.md

The ``single`` cell of tiny (seq 128, batch 8, fp32, default flags) is built as the worker builds it (a gloo group
of one on loopback, ``place``, ``build_cell``, ``Batches``), and each thing the worker's loop
(``harness/run/worker.py``, ``_measure``) does per step is timed alone over many calls (the median of 15 blocks):

* in the clock (between the timer's start and stop): ``train_step``'s own code beyond a plain step (zero_grad,
  forward, loss, backward, optimizer), timed on a model of one small linear layer so that the difference is the
  wrapper's and not the model's; its NVTX phase ranges (enabled, as by default, with no tool attached);
* between steps (in the loop, outside the clock): the step's NVTX ranges, the CPU clock pair, the batch, the
  learning rate, the heartbeat, the loss read back;
* the host monitor's sample (on its thread beside the step before issue 62, between steps since), per sample and
  per step at its rate; Python's garbage collector and the page faults of one real step (the cell's against a plain
  step of the same model, in this process).

Run in another checkout (``git worktree add /tmp/before HEAD~1``, the script copied in, ``PYTHONPATH=/tmp/before``) it
measures that code: the before and after tables of results/reference/harness-cost/issue62.

Prints the table and writes it to OUT (refused if OUT exists: nothing measured is overwritten).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from harness.measure.monitor import make_monitor
from harness.measure.nvtx_ranges import Ranges
from harness.measure.timer import StepTimer
from harness.parallel.parallelized import Parallelized
from harness.planner import expand
from harness.precision import PrecisionPlan
from harness.run import train
from harness.run.cell_build import Batches, build_cell, place
from harness.run.heartbeat import Heartbeat
from harness.spec import SweepSpec
from workloads.model import lm_loss

SEQ, BATCH, VOCAB = 128, 8, 64
BLOCKS = 15


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median over :data:`BLOCKS` blocks of ``calls`` calls, microseconds per call."""
    fn()
    blocks = []
    for _ in range(BLOCKS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        blocks.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(blocks)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def wrapper_us(nvtx: bool) -> float:
    """``train_step`` less a plain step, on a model of one linear layer (the step's own code, not the model's),
    on one thread (the wrapper is Python; a second thread's barrier would only add noise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _wrapper_us(nvtx)
    finally:
        torch.set_num_threads(threads)


def _wrapper_us(nvtx: bool) -> float:
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        sides.append((model, opt))
    (model, opt), (bmodel, bopt) = sides
    ctx = train.StepContext(par=Parallelized(parts=[model], model=model, pipeline=None, data_parallel="none"),
                            optimizer=opt, precision=PrecisionPlan("fp32"), scaler=None, device_kind="cpu",
                            grad_accum=1, ranges=Ranges(enabled=nvtx))
    x = torch.randint(0, VOCAB, (2, 8))
    wrapped, plain = [], []
    for _ in range(5):  # interleaved blocks: drift hits both alike
        wrapped.append(per_call_us(lambda: train.train_step(ctx, x, x, 1e-3), 40))
        plain.append(per_call_us(lambda: plain_step(bmodel, bopt, x, x), 40))
    return statistics.median(w - p for w, p in zip(wrapped, plain))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_single():
    """The ``single`` tiny cell as the worker builds it: config from the planner, a gloo group of one."""
    spec = SweepSpec(sizes=("tiny",), strategies=("single",), precisions=("fp32",), gpus=(1,), device_kind="cpu",
                     batch=BATCH, steps=20, warmup=3, seq_lens=(SEQ,))
    (cell,) = [c for c in expand(spec) if not c.reference_only]
    assert cell.config is not None, cell.reason
    cfg = cell.config
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    dist.init_process_group("gloo")
    where = place(cfg)
    built = build_cell(cfg, where.device)
    return cfg, built, Batches(cfg, built, where.device)


def step_faults_and_gc(built, batches: Batches, steps: int = 20) -> dict[str, float]:
    """Per real step of the cell, and of a plain step of the same model: minor page faults, GC collections."""
    size = replace(built.size, seq_len=SEQ)
    torch.manual_seed(0)
    from workloads.model import Decoder  # noqa: PLC0415

    bmodel = Decoder(size)
    bopt = torch.optim.AdamW(bmodel.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    collections: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        else:
            collections.append(time.perf_counter() - started.pop())

    faults: dict[str, list[int]] = {"cell": [], "plain": []}
    gc.callbacks.append(on_gc)
    try:
        for step in range(3 + steps):
            x, y = batches(step)
            for side in ("cell", "plain"):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                if side == "cell":
                    train.train_step(built.ctx, x, y, batches.lr(step))
                else:
                    plain_step(bmodel, bopt, x, y)
                if step >= 3:
                    faults[side].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    finally:
        gc.callbacks.remove(on_gc)
    return {"faults_cell": statistics.median(faults["cell"]), "faults_plain": statistics.median(faults["plain"]),
            "gc_per_step": len(collections) / (2 * (3 + steps)),
            "gc_us_per_step": sum(collections) * 1e6 / (2 * (3 + steps))}


def step_seconds(built, batches: Batches) -> float:
    x, y = batches(0)
    return per_call_us(lambda: train.train_step(built.ctx, x, y, 1e-3), 3) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; choose a new file (nothing measured is overwritten)")
    cfg, built, batches = build_single()
    step_s = step_seconds(built, batches)
    ranges, timer = built.ranges, StepTimer("cpu")
    x, y = batches(0)
    loss = train.train_step(built.ctx, x, y, 1e-3)[0]
    assert loss is not None
    monitor = make_monitor("cpu", [], rate_hz=cfg.monitor_hz, pids=[os.getpid()])
    sampler = monitor.sampler
    monitor_at = "between steps" if getattr(monitor, "between_steps", False) else "beside the step (its thread)"
    per_step_samples = cfg.monitor_hz * step_s
    with tempfile.TemporaryDirectory() as tmp:
        beat = Heartbeat(Path(tmp), 0)
        beat.open_window()

        def step_ranges() -> None:
            with ranges.range("step", payload=1), ranges.train_step(1):
                pass

        def timer_pair() -> None:
            timer.start()
            timer.stop()

        def cpu_clock_pair() -> None:
            time.process_time()
            time.process_time()

        rows: list[tuple[str, str, float, float]] = [
            ("train_step's own code beyond a plain step (NVTX ranges off)", "in the clock", wrapper_us(False), 1),
            ("train_step's own code beyond a plain step (its NVTX ranges on, no tool attached)", "in the clock",
             wrapper_us(True), 1),
            ("step timer start + stop", "in the clock (its edges)", per_call_us(timer_pair, 2000), 1),
            ("NVTX step + train_step_<n> ranges", "between steps", per_call_us(step_ranges, 2000), 1),
            ("CPU clock pair (time.process_time x2)", "between steps", per_call_us(cpu_clock_pair, 2000), 1),
            ("the batch (Batches.__call__)", "between steps", per_call_us(lambda: batches(1), 200), 1),
            ("the learning rate (Batches.lr)", "between steps", per_call_us(lambda: batches.lr(1), 2000), 1),
            ("heartbeat (os.utime)", "between steps", per_call_us(beat.beat, 2000), 1),
            ("loss read back (float(loss))", "between steps", per_call_us(lambda: float(loss), 2000), 1),
            (f"host monitor sample (psutil, {cfg.monitor_hz:g} Hz)", monitor_at,
             per_call_us(sampler.sample, 200), per_step_samples),
        ]
        beat.close_window()
    fg = step_faults_and_gc(built, batches)
    dist.destroy_process_group()
    lines = [f"The `single` cell of tiny (seq {SEQ}, batch {BATCH}, fp32, {torch.get_num_threads()} threads), its "
             f"step {step_s * 1e3:.1f} ms here; each cost measured alone (median of {BLOCKS} blocks).", "",
             "| per-step cost | where | us per call | calls per step | us per step | % of the step |",
             "|---|---|---|---|---|---|"]
    for what, where, us, calls in rows:
        lines.append(f"| {what} | {where} | {us:.2f} | {calls:.3g} | {us * calls:.2f} | "
                     f"{us * calls / (step_s * 1e6) * 100:.3f} |")
    lines += ["", f"Page faults (minor) per step, median of 20: the cell's step {fg['faults_cell']:.0f}, a plain step "
                  f"of the same model in this process {fg['faults_plain']:.0f}. Python's garbage collector: "
                  f"{fg['gc_per_step']:.2f} collections per step ({fg['gc_us_per_step']:.1f} us per step)."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
