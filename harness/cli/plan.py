"""``harness plan``: the cells a sweep would run (nothing launched), or a what-if on a hardware preset."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.calibration.ops import with_measured
from harness.cli.arg_values import (
    choices,
    csv_list,
    degrees_arg,
    fraction,
    int_arg,
    ints,
    model_notes,
    models_arg,
    path_arg,
    positive_float,
    seq_lens_arg,
    workload_keys,
)
from harness.cli.args import RUN_DEVICES, SP_MODES, add_sweep_args, device_line, merged, spec_from_args
from harness.errors import UsageError
from harness.fit.measured_peaks import load_fit_records, with_measured_peaks
from harness.model.checkpoint_cost import DEFAULT_WRITE_GBPS
from harness.model.device_file import device_arg
from harness.model.hardware import DEVICES
from harness.model.whatif import CompileGain, plan_at_scale, scenario
from harness.parallel.levers import COMPILE_MODES
from harness.parallel.schedules import PP_SCHEDULES
from harness.planner import expand
from harness.precision import FP8_RECIPES
from harness.records.reader import load_records
from harness.report.lever_gains import compile_speedup
from harness.report.model_error import model_error
from harness.report.plan_text import plan_table
from harness.report.published import published_error_line
from harness.report.whatif_text import BANNER, assumptions_lines, error_line, explain_table, whatif_table
from workloads.sizes import ARCHS, DEFAULT_ARCH, get_size

FIT_BANNER = ("PREDICTIONS from the analytic model (harness/model), except peak memory where `harness fit` measured "
              "it (--fit-from; noted per row): nothing here ran on the named hardware.")

WHATIF_DEFAULT_SIZE = {"gpt2": "xl", "llama3": "8b", "moe": "mixtral-8x7b"}
ERROR_FROM = Path("results/reference/rounds-cpu-tiny-mini-w2-w4-C")
"""The rounds reference the model is judged on (results/reference/README.md)."""


def add_whatif_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(f"what-if (--device {'|'.join(DEVICES)} or a device file DEVICE.toml: predict, "
                             "do not run; harness.model.device_file.py documents the file)")
    g.add_argument("--recompute", default=None,
                   help="activation checkpointing policy, as --ac takes it: none (default), attn, op, layerN, full")
    g.add_argument("--efficiency", help="price the compute as the model FLOPs at this fraction of the datasheet peak, "
                                        "in (0, 1], one fraction for every op (default: priced op by op on the "
                                        "device, harness/model/op_step.py)")
    g.add_argument("--explain", action="store_true", default=None,
                   help="where each row's step goes: GEMMs, attention, memory-bound kernels, host-bound launches, "
                        "the optimizer, exposed communication and the bubble, in ms and %% of the step")
    g.add_argument("--rms-norm", choices=("fused", "composite"), default=None,
                   help="RMSNorm as torch's fused kernel (default; torch 2.8 onwards) or as the separate kernels "
                        "earlier torch ran (to price a run made on it)")
    g.add_argument("--attention-kernel", default=None,
                   help="the attention kernel's measured rates, in place of the device's (fa2_hopper, cudnn_hopper, "
                        "fa2_ampere: harness/model/device_rates.toml); e.g. cudnn_hopper for Transformer Engine on "
                        "an H100")
    g.add_argument("--inductor-reductions", default=None,
                   help="under --compile on, the share of the achievable bandwidth torch.compile's fused kernels with "
                        "a norm, softmax or loss in them reach, in (0, 1]: 1 (default; torch 2.13's Inductor) or 0.5 "
                        "to price a run on the torch of 2024 (docs/op-pricing.md)")
    g.add_argument("--error-from", type=path_arg, default=None,
                   help="run directory whose records carry predictions, for the model's measured error "
                        "(default results/reference/rounds-cpu-tiny-mini-w2-w4-C, the rounds reference)")
    g.add_argument("--moe-imbalance", default=None,
                   help="--arch moe: the busiest expert's load over the mean, e.g. a record's "
                        "metrics.moe.imbalance_max_over_mean (default 1: balanced); scales expert-parallel "
                        "ranks' expert compute")
    g.add_argument("--device-mem", default=None,
                   help="the device's memory in GiB, overriding the preset's (e.g. --device h100 --device-mem 96)")
    g.add_argument("--power-cap", default=None,
                   help="a power limit in W below the preset's board power: compute peaks x (cap / board power) ** "
                        "(1/3), HBM and links unscaled (e.g. --device h100 --power-cap 500)")
    g.add_argument("--compile-from", type=path_arg, default=None,
                   help="with --compile on: run directories whose compiled cells beside eager ones on the device's "
                        "product price the gain (default results/gpu); none there: compile is not priced, and said")
    g.add_argument("--checkpoint-gbps", default=None,
                   help="with --checkpoint-every: the write bandwidth per GPU its saves are priced at, GB/s "
                        "(default 1, an assumption the output names)")
    g.add_argument("--fit-from", type=path_arg, default=None,
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


COMPILE_FROM = Path("results/gpu")


def _compile_gain(v, device, where: Path | None) -> CompileGain | None:
    """``--compile on``: the gain measured on this device's product in ``--compile-from`` (records of compiled
    cells beside their eager counterparts), or a gain of None with the reason; None with compile off."""
    modes = choices(v.label("compile"), v.get("compile", "off"), COMPILE_MODES)
    if len(modes) > 1:
        raise UsageError(f"{v.label('compile')} {','.join(modes)}: a what-if prices one; give on or off")
    if modes[0] == "off":
        return None
    where = where or COMPILE_FROM
    records = [r for path in sorted(where.rglob("records.jsonl*")) for r in load_records(path)] if where.is_dir() else []
    speedup, pairs = compile_speedup(records, device.product)
    if speedup is None:
        return CompileGain(None, f"no measurement on this device: no compiled cell beside its eager one on "
                                 f"{device.product} in {where}")
    return CompileGain(speedup, f"{pairs} pair(s) on {device.product} in {where}")


def _one_recipe(v) -> str:
    recipes = choices(v.label("fp8_recipe"), v.get("fp8_recipe", "tensorwise"), FP8_RECIPES)
    if len(recipes) > 1:
        raise UsageError(f"{v.label('fp8_recipe')} {','.join(recipes)}: a what-if prices one recipe; give one")
    return recipes[0]


def cmd_plan_whatif(args: argparse.Namespace) -> int:
    """``harness plan --device PRESET``: rank strategies by predicted tokens/s per device."""
    v = merged(args)
    device = with_measured(device_arg(
        str(v["device"]), mem_gib=positive_float(v.label("device_mem"), v["device_mem"]) if "device_mem" in v else None,
        power_cap_w=positive_float(v.label("power_cap"), v["power_cap"]) if "power_cap" in v else None,
        attention=str(v["attention_kernel"]) if "attention_kernel" in v else None))
    if "nnodes" in v:
        raise UsageError(f"--nnodes {v['nnodes']}: the what-if takes --gpus as the total and fills nodes of "
                         f"{device.gpus_per_node} ({device.name}); drop --nnodes")
    if "gpus" not in v:
        raise UsageError(f"--device {device.name} predicts at a device count: give --gpus N, e.g. --gpus 64")
    if v.get("scaling", "strong") != "strong":
        raise UsageError(f"--scaling {v['scaling']}: the what-if takes --batch as the global batch; drop --scaling")
    efficiency = fraction(v.label("efficiency"), v["efficiency"]) if "efficiency" in v else None
    models = models_arg(v, "cuda")  # a what-if prices the model as given, never shrunk
    archs = choices(v.label("arch"), v.get("arch", DEFAULT_ARCH), ARCHS)
    sizes: list = list(models) or (workload_keys(archs, csv_list(v["sizes"])) if "sizes" in v
                                   else [get_size(WHATIF_DEFAULT_SIZE[a], a).key for a in archs])
    strategies = csv_list(v["strategies"]) if v.get("strategies") else None
    seq_lens = seq_lens_arg(v.label("seq_len"), v["seq_len"]) if "seq_len" in v else (None,)
    pp_schedules = choices(v.label("pp_schedule"), v.get("pp_schedule", "1f1b"), PP_SCHEDULES)
    opts = dict(global_batch=int_arg(v.label("batch"), v["batch"], 1) if "batch" in v else None,
                recompute=v.get("recompute", "none"),
                microbatches=int_arg(v.label("microbatches"), v["microbatches"], 1) if "microbatches" in v else None,
                efficiency=efficiency, pp_schedule=pp_schedules[0],
                grad_accum=int_arg(v.label("grad_accum"), v.get("grad_accum", 1), 1), degrees=degrees_arg(v.get("degrees")),
                moe_imbalance=_imbalance(v.label("moe_imbalance"), v["moe_imbalance"]) if "moe_imbalance" in v else 1.0,
                checkpoint_every=int_arg(v.label("checkpoint_every"), v["checkpoint_every"], 1)
                if "checkpoint_every" in v else None,
                checkpoint_gbps=positive_float(v.label("checkpoint_gbps"), v["checkpoint_gbps"])
                if "checkpoint_gbps" in v else DEFAULT_WRITE_GBPS,
                fused_rms_norm=v.get("rms_norm", "fused") == "fused", fp8_recipe=_one_recipe(v),
                inductor_reductions=fraction(v.label("inductor_reductions"), v["inductor_reductions"],
                                             of="the achievable bandwidth", e_g="0.5")
                if "inductor_reductions" in v else 1.0)
    if v.get("explain") and efficiency is not None:
        raise UsageError("--explain with --efficiency: the breakdown is the op-by-op pricing's; drop --efficiency")
    sps = tuple(x == "on" for x in choices(v.label("sp"), v.get("sp", "on"), SP_MODES))
    opts["compile"] = _compile_gain(v, device, args.compile_from)
    # one ranking per (size, sequence length, precision, device count): strategies compete at fixed work
    sections = [(size, seq, prec, gpus) for size in sizes for seq in seq_lens
                for prec in csv_list(v.get("precision", "bf16")) for gpus in ints(v.label("gpus"), v["gpus"])]
    for size, seq, prec, gpus in sections:  # every value is checked before anything is printed
        scenario(size, device, gpus, prec, seq_len=seq, sequence_parallel=sps[0], **opts)
    run_dir = args.error_from or ERROR_FROM
    fit_records = load_fit_records(args.fit_from) if args.fit_from else None
    print(BANNER if fit_records is None else FIT_BANNER)
    for line in model_notes(models):
        print(line)
    for size, seq, prec, gpus in sections:
        s = scenario(size, device, gpus, prec, seq_len=seq, sequence_parallel=sps[0], **opts)
        print()
        print(f"## {s.size.key}, seq {s.size.seq_len}, {prec}, {gpus} GPUs")
        print("\n".join(assumptions_lines(s)))
        print()
        rows = plan_at_scale(size, device, gpus, strategies, precision=prec, seq_len=seq, sequence_parallels=sps,
                             pp_schedules=pp_schedules, **opts)
        if fit_records is not None:
            rows = with_measured_peaks(rows, fit_records, s.size.key, prec, s.size.seq_len, device.hbm_gib,
                                       args.fit_from)
        print(whatif_table(rows))
        if v.get("explain"):
            print()
            print("where the step goes (the slowest pipeline rank's microbatches priced op by op; host-bound: the GPU "
                  "waiting for eager launches and syncs):")
            print(explain_table(rows))
    print()
    print(error_line(model_error(run_dir), run_dir))
    if efficiency is None and (published := published_error_line()) is not None:
        print(published)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if merged(args).get("device", "auto") not in RUN_DEVICES:
        return cmd_plan_whatif(args)
    for flag in ("recompute", "efficiency", "error_from", "fit_from", "moe_imbalance", "device_mem", "power_cap",
                 "compile_from", "checkpoint_gbps", "explain", "rms_norm", "inductor_reductions",
                 "attention_kernel"):
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to a what-if only: add --device h100 "
                             f"(or {', '.join(d for d in DEVICES if d != 'h100')})")
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
