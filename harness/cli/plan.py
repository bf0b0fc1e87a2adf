"""``harness plan``: the cells a sweep would run (nothing launched), or a what-if on a hardware preset."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import (
    RUN_DEVICES,
    SP_MODES,
    add_sweep_args,
    choices,
    csv_list,
    degrees_arg,
    device_line,
    fraction,
    int_arg,
    ints,
    merged,
    seq_lens_arg,
    spec_from_args,
    workload_keys,
)
from harness.errors import UsageError
from harness.fit.measured_peaks import load_fit_records, with_measured_peaks
from harness.model.hardware import get_device
from harness.model.whatif import plan_at_scale, scenario
from harness.planner import expand
from harness.report.model_error import model_error
from harness.report.plan_text import plan_table
from harness.report.whatif_text import BANNER, assumptions_lines, error_line, whatif_table
from workloads.sizes import ARCHS, DEFAULT_ARCH, get_size

FIT_BANNER = ("PREDICTIONS from the analytic model (harness/model), except peak memory where `harness fit` measured "
              "it (--fit-from; noted per row): nothing here ran on the named hardware.")

WHATIF_DEFAULT_SIZE = {"gpt2": "xl", "llama3": "8b", "moe": "mixtral-8x7b"}
ERROR_FROM = Path("results/reference/model-cpu-tiny-mini-w2-w4-r5")


def add_whatif_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what-if (--device h100|h100-pcie|h200|a100: predict, do not run)")
    g.add_argument("--recompute", default=None,
                   help="activation checkpointing policy, as --ac takes it: none (default), attn, op, layerN, full")
    g.add_argument("--efficiency", help="compute rate as a fraction of the datasheet peak, in (0, 1] "
                                        "(default: MAMF x kernel efficiency measured on one H200)")
    g.add_argument("--error-from", type=Path, default=None,
                   help="run directory whose records carry predictions, for the model's measured error "
                        "(default results/reference/model-cpu-tiny-mini-w2-w4-r5)")
    g.add_argument("--moe-imbalance", default=None,
                   help="--arch moe: the busiest expert's load over the mean, e.g. a record's "
                        "metrics.moe.imbalance_max_over_mean (default 1: balanced); scales expert-parallel "
                        "ranks' expert compute")
    g.add_argument("--fit-from", type=Path, default=None,
                   help="harness fit run directory: its measured peaks replace the predicted ones where a record "
                        "matches (size, strategy, N, precision, global batch)")


def _imbalance(label: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{label} {text!r}: must be a number >= 1, e.g. 1.4") from None
    if not value >= 1.0:
        raise UsageError(f"{label} {text!r}: must be >= 1 (the busiest expert's load over the mean)")
    return value


def cmd_plan_whatif(args: argparse.Namespace) -> int:
    """``harness plan --device PRESET``: rank strategies by predicted tokens/s per device."""
    v = merged(args)
    device = get_device(v["device"])
    if "nnodes" in v:
        raise UsageError(f"--nnodes {v['nnodes']}: the what-if takes --gpus as the total and fills nodes of "
                         f"{device.gpus_per_node} ({device.name}); drop --nnodes")
    if "gpus" not in v:
        raise UsageError(f"--device {device.name} predicts at a device count: give --gpus N, e.g. --gpus 64")
    if v.get("scaling", "strong") != "strong":
        raise UsageError(f"--scaling {v['scaling']}: the what-if takes --batch as the global batch; drop --scaling")
    efficiency = fraction(v.label("efficiency"), v["efficiency"]) if "efficiency" in v else None
    archs = choices(v.label("arch"), v.get("arch", DEFAULT_ARCH), ARCHS)
    sizes = (workload_keys(archs, csv_list(v["sizes"])) if "sizes" in v
             else [get_size(WHATIF_DEFAULT_SIZE[a], a).key for a in archs])
    strategies = csv_list(v["strategies"]) if v.get("strategies") else None
    seq_lens = seq_lens_arg(v.label("seq_len"), v["seq_len"]) if "seq_len" in v else (None,)
    opts = dict(global_batch=int_arg(v.label("batch"), v["batch"], 1) if "batch" in v else None,
                recompute=v.get("recompute", "none"),
                microbatches=int_arg(v.label("microbatches"), v["microbatches"], 1) if "microbatches" in v else None,
                efficiency=efficiency, pp_schedule=v.get("pp_schedule", "1f1b"),
                grad_accum=int_arg(v.label("grad_accum"), v.get("grad_accum", 1), 1), degrees=degrees_arg(v.get("degrees")),
                moe_imbalance=_imbalance(v.label("moe_imbalance"), v["moe_imbalance"]) if "moe_imbalance" in v else 1.0)
    sps = tuple(x == "on" for x in choices(v.label("sp"), v.get("sp", "on"), SP_MODES))
    # one ranking per (size, sequence length, precision, device count): strategies compete at fixed work
    sections = [(size, seq, prec, gpus) for size in sizes for seq in seq_lens
                for prec in csv_list(v.get("precision", "bf16")) for gpus in ints(v.label("gpus"), v["gpus"])]
    for size, seq, prec, gpus in sections:  # every value is checked before anything is printed
        scenario(size, device, gpus, prec, seq_len=seq, sequence_parallel=sps[0], **opts)
    run_dir = args.error_from or ERROR_FROM
    fit_records = load_fit_records(args.fit_from) if args.fit_from else None
    print(BANNER if fit_records is None else FIT_BANNER)
    for size, seq, prec, gpus in sections:
        s = scenario(size, device, gpus, prec, seq_len=seq, sequence_parallel=sps[0], **opts)
        print()
        print(f"## {size}, seq {s.size.seq_len}, {prec}, {gpus} GPUs")
        print("\n".join(assumptions_lines(s)))
        print()
        rows = plan_at_scale(size, device, gpus, strategies, precision=prec, seq_len=seq, sequence_parallels=sps,
                             **opts)
        if fit_records is not None:
            rows = with_measured_peaks(rows, fit_records, size, prec, s.size.seq_len, device.hbm_gib, args.fit_from)
        print(whatif_table(rows))
    print()
    print(error_line(model_error(run_dir), run_dir))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if merged(args).get("device", "auto") not in RUN_DEVICES:
        return cmd_plan_whatif(args)
    for flag in ("recompute", "efficiency", "error_from", "fit_from", "moe_imbalance"):
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to a what-if only: add --device h100 "
                             f"(or h100-pcie, h200, a100)")
    spec = spec_from_args(args)
    cells = expand(spec)
    print(device_line(spec))
    print(plan_table(cells))
    return 0


def register(sub) -> None:
    p = sub.add_parser("plan", help="expand and validate a sweep without launching anything, or predict "
                                    "strategies on a hardware preset (--device h100 --gpus 64)")
    add_sweep_args(p)
    add_whatif_args(p)
    p.set_defaults(fn=cmd_plan)
