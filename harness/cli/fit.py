"""``harness fit``: measure whether a cell fits, as one rank of N devices, on the one device here."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from itertools import product
from pathlib import Path

import psutil
import torch

from harness.cli.arg_values import (
    choices,
    csv_list,
    degrees_arg,
    int_arg,
    ints,
    model_notes,
    models_arg,
    path_arg,
    seq_lens_arg,
    workload_keys,
)
from harness.cli.args import Settings
from harness.errors import UsageError
from harness.fit.cell import plan_fit_cell
from harness.fit.fit_cells import RECORDS, fit_all
from harness.fit.role_spec import COMPUTE
from harness.model.device_file import device_from_file
from harness.model.hardware import DEVICES
from harness.parallel.activation_checkpoint import policies_arg
from harness.parallel.presets import degree_variants
from harness.parallel.schedules import PP_SCHEDULES, check_schedule_ac
from harness.records.atomic import write_text_atomic
from harness.records.record import new_run_id
from harness.report.fit_text import BANNER, fit_table, legend
from harness.run.rundir import check_writable
from harness.spec import default_device_kind
from harness.units import GIB
from workloads.own_model import OwnModel
from workloads.sizes import ARCHS, DEFAULT_ARCH, ModelSize, get_size, seq_len_error

FLAGS = ("arch", "model", "gpus", "nnodes", "sizes", "strategies", "precision", "ac", "batch", "device_mem", "device", "compute",
         "steps", "seq_len", "microbatches", "pp_schedule", "degrees", "out")
"""Flags written back into fit.md's command line."""
DEFAULTS = {"cpu": dict(sizes="tiny", precision="fp32"), "cuda": dict(sizes="small", precision="bf16")}


def device_mem_arg(value: str | None, device_kind: str) -> tuple[float, str]:
    """``--device-mem``: GiB (> 0), a preset's HBM or a device file's (:mod:`harness.model.device_file`); default the
    local device's memory. (GiB, where from)."""
    if value is None:
        if device_kind == "cuda":
            return torch.cuda.get_device_properties(0).total_memory / GIB, f"{torch.cuda.get_device_name(0)} memory"
        return psutil.virtual_memory().total / GIB, "this host's RAM"
    if value.strip().endswith(".toml"):
        dev = device_from_file(Path(value.strip()))
        return dev.hbm_gib, f"--device-mem {value.strip()} ({dev.product}, {dev.hbm_gib:g} GiB)"
    name = value.strip().lower()
    if name in DEVICES:
        return DEVICES[name].hbm_gib, f"--device-mem {name} ({DEVICES[name].product} HBM)"
    try:
        gib = float(name)
    except ValueError:
        raise UsageError(f"--device-mem {value!r}: not a number of GiB nor a preset; give GiB > 0 (e.g. 80), "
                         f"one of {', '.join(DEVICES)} or a device file (DEVICE.toml)") from None
    if not gib > 0:
        raise UsageError(f"--device-mem {value!r}: must be > 0 GiB, e.g. 80 (H100) or a preset: {', '.join(DEVICES)}")
    return gib, f"--device-mem {gib:g} GiB"


def _device(value: str | None) -> str:
    device = value or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: fit runs on auto, cpu or cuda; name a preset's memory with "
                         f"--device-mem {device}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    return default_device_kind() if device == "auto" else device


def _compute(value: str, device_kind: str, size: ModelSize | OwnModel) -> str:
    if value == "auto":  # a GPU-class size's real step takes this CPU minutes to hours per rank role
        return "fake" if device_kind == "cpu" and size.device_kind != "cpu" else "real"
    return value


def _workloads(args: argparse.Namespace, device_kind: str) -> list[ModelSize | OwnModel]:
    """The sizes asked for, or the ``--model`` ones as given (fit measures the model itself, never shrunk)."""
    given = {k: v for k, v in (("model", args.model), ("sizes", args.sizes), ("arch", args.arch)) if v is not None}
    models = models_arg(Settings(given), "cuda")
    if models:
        return list(models)
    keys = workload_keys(choices("--arch", args.arch or DEFAULT_ARCH, ARCHS),
                         csv_list(args.sizes or DEFAULTS[device_kind]["sizes"]))
    return [get_size(k) for k in keys]


def _tables(records: list[dict]) -> str:
    """The fit table; one per sequence length when several were fitted (the table has no seq column)."""
    seqs = list(dict.fromkeys(r["config"]["seq_len"] for r in records))
    if len(seqs) <= 1:
        return fit_table(records)
    return "\n\n".join(f"seq {seq}:\n\n" + fit_table([r for r in records if r["config"]["seq_len"] == seq])
                       for seq in seqs)


def cmd_fit(args: argparse.Namespace) -> int:
    device_kind = _device(args.device)
    d = DEFAULTS[device_kind]
    gpus = ints("--gpus", args.gpus)
    nnodes = int_arg("--nnodes", args.nnodes, 1)
    sizes = _workloads(args, device_kind)
    auto = str(args.batch).strip() == "auto"
    micro = 1 if auto else int_arg("--batch", args.batch, 1)
    steps = int_arg("--steps", args.steps, 1)
    mem_gib, mem_from = device_mem_arg(args.device_mem, device_kind)
    degrees = degrees_arg(args.degrees)
    seq_lens = seq_lens_arg("--seq-len", args.seq_len) if args.seq_len is not None else (None,)
    mbs = int_arg("--microbatches", args.microbatches, 1) if args.microbatches else None
    acs = policies_arg("--ac", args.ac)
    check_schedule_ac((args.pp_schedule,), acs)
    cells, compute = [], {}
    for size in sizes:  # every cell is validated before anything runs
        for seq in seq_lens:
            if seq and isinstance(size, ModelSize) and (error := seq_len_error(size, seq)):
                raise UsageError(f"--seq-len: {error}")
        compute[size.key] = _compute(args.compute, device_kind, size)
        for seq, prec, g, strategy, ac in product(seq_lens, csv_list(args.precision or d["precision"]), gpus,
                                                  csv_list(args.strategies), acs):
            moe = size.moe
            experts = moe.n_experts if moe else None
            variants: Sequence[dict | None] = (None if degrees else degree_variants(strategy, g * nnodes, experts)) \
                or [degrees]
            for cell_degrees in variants:
                cells.append(plan_fit_cell(size, strategy, prec, g * nnodes, micro, device_kind, seq_len=seq,
                                           microbatches=mbs, pp_schedule=args.pp_schedule, nnodes=nnodes,
                                           degrees=cell_degrees, ac=ac, compute=compute[size.key]))
    out = args.out or Path("results") / f"fit-{new_run_id()}"
    if (out / RECORDS).exists():
        raise UsageError(f"--out {out}: already holds {RECORDS}; choose a new directory")
    check_writable(out)
    modes = ", ".join(f"{s}: {c}" for s, c in compute.items())
    print(BANNER)
    print(f"device: {device_kind}; budget {mem_gib:.1f} GiB per rank ({mem_from}); compute {modes}; "
          f"{'--batch auto: largest micro-batch that fits' if auto else f'micro-batch {micro}'}; out {out}",
          flush=True)
    records = []
    run_id = new_run_id()
    for line in model_notes(tuple(sizes)):
        print(line, flush=True)
    for size in sizes:
        records += fit_all([c for c in cells if c.size == size.key], out, run_id, steps, mem_gib, auto,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = _tables(records)
    print(table)
    print(legend(records))
    command = "harness fit " + " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items()
                                        if k in FLAGS and v is not None)
    write_text_atomic(out / "fit.md", "\n\n".join([BANNER, f"`{command}`", table, legend(records)]) + "\n")
    return 0 if all(r["status"] in ("ok", "oom") for r in records) else 1


def register(sub) -> None:
    p = sub.add_parser("fit", help="measure whether cells fit: each rank role of N devices run on this one device "
                                   "with fake collectives (memory only; no time or throughput)")
    p.add_argument("--gpus", required=True, help="devices per node N (a list fits several: 8,64)")
    p.add_argument("--nnodes", default="1", help="nodes; the world is gpus x nnodes")
    p.add_argument("--arch", help="architecture families: gpt2,llama3 (default gpt2)")
    p.add_argument("--sizes", help="workload sizes (default tiny on CPU, small on GPU)")
    p.add_argument("--model", help="your own model: a config.json (or a folder holding one), fitted as given; a list "
                                   "fits each; in place of --sizes/--arch")
    p.add_argument("--strategies", default="fsdp", help="fsdp,zero2,hsdp,tp,tp-sp,pp,fsdp+tp,pp+fsdp,pp+fsdp+tp,ddp")
    p.add_argument("--precision", help="fp32,bf16,... (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--ac", default="none", help="activation checkpointing: none,selective,full (a list fits each)")
    p.add_argument("--batch", default="1", help="micro-batch: sequences per data-parallel rank per micro-step "
                                                "(per pipeline microbatch), or auto: the largest that fits")
    p.add_argument("--device-mem", help=f"memory budget per rank: GiB, or a preset's HBM ({', '.join(DEVICES)}); "
                                        "default the local device's memory")
    p.add_argument("--device", help="auto (default), cpu or cuda: where the roles run")
    p.add_argument("--compute", choices=("auto",) + COMPUTE, default="auto",
                   help="real arithmetic, or fake (FakeTensorMode: allocations at real shapes, no arithmetic); "
                        "auto: fake for GPU-class sizes on a CPU, else real")
    p.add_argument("--steps", default="2", help="training steps per role (the first allocates the optimizer state)")
    p.add_argument("--seq-len", help="tokens per sequence (default: the size's); a list fits each: 2048,4096")
    p.add_argument("--microbatches", help="pipeline microbatches (default 2 x pp)")
    p.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES)
    p.add_argument("--degrees", help="explicit degrees overriding the presets, e.g. pp=2,tp=2")
    p.add_argument("--out", type=path_arg, help="run directory (default results/fit-<run-id>)")
    p.set_defaults(fn=cmd_fit)
