"""The sweep flags every subcommand shares, and turning them into a :class:`~harness.spec.SweepSpec`.

Bad input is one line on stderr naming the value and the fix, exit code 2, before anything
is launched or written. Precedence: CLI flags > sweep file (TOML) > defaults.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Callable
from pathlib import Path

import torch

from harness.cli.arg_values import (
    checkpoints_arg,
    choices,
    csv_list,
    degrees_arg,
    int_arg,
    ints,
    listed,
    model_notes,
    models_arg,
    path_arg,
    positive_float,
    rate_value,
    restore_from_arg,
    seq_lens_arg,
)
from harness.errors import UsageError
from harness.model.hardware import DEVICES
from harness.parallel.activation_checkpoint import policies_arg
from harness.parallel.levers import COMPILE_MODES, OPTIMIZERS
from harness.parallel.presets import PP_PRESETS, STRATEGIES
from harness.parallel.schedules import PP_SCHEDULES, check_schedule_ac, check_schedule_compile
from harness.precision import FP8_RECIPES, PRECISIONS
from harness.spec import SweepSpec, default_device_kind
from workloads.moe import ROUTINGS
from workloads.sizes import ARCHS, DEFAULT_ARCH

EXIT_USAGE = 2
RUN_DEVICES = ("auto", "cpu", "cuda")
SP_MODES = ("on", "off")
"""``--device`` values a sweep can run on; ``harness plan`` also takes hardware presets (what-if)."""
DEFAULTS = {
    "cpu": dict(sizes="tiny", precision="fp32", batch=8, steps=20, warmup=3),
    "cuda": dict(sizes="small", precision="bf16", batch=8, steps=30, warmup=5),
}


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep matrix")
    g.add_argument("--sweep", type=path_arg, help="TOML sweep file; flags given on the command line override it")
    g.add_argument("--gpus", help="devices per node (CPU ranks without a GPU); a list sweeps device counts: 1,2,4")
    g.add_argument("--sizes", help="workload sizes (harness workloads lists them)")
    g.add_argument("--arch", help="architecture families: gpt2,llama3,moe (default gpt2); each size is looked up in each")
    g.add_argument("--model", help="your own model: a Hugging Face style config.json, or a folder holding one (no "
                                   "weights read, nothing fetched), or package.module:factory for an nn.Module of your "
                                   "own (docs/models.md); a list sweeps several; in place of --sizes/--arch")
    g.add_argument("--full-size", action="store_true", default=None,
                   help="--model on CPU ranks: run it as given, not shrunk to CPU scale (docs/models.md)")
    g.add_argument("--moe-routing", help="an MoE's routing: learned (the router's top-k, default) or balanced (round "
                                         "robin: equal expert load, the best case); a list sweeps both")
    g.add_argument("--strategies", help=", ".join(STRATEGIES))
    g.add_argument("--precision", help=", ".join(PRECISIONS))
    g.add_argument("--sp", help="on,off: sequence parallel wherever a layout has tensor parallel (default on, as "
                                "torchtitan and Megatron run it; the tp and tp-sp presets say it by name)")
    g.add_argument("--fp8-recipe", help=f"--precision fp8: torchao's scaling recipe, {', '.join(FP8_RECIPES)} "
                                        "(default tensorwise); a list sweeps them")
    g.add_argument("--fp8-all-gather", help="off,on: --precision fp8 under FSDP gathers the converted weights in "
                                            "float8 (tensorwise; default off); a list sweeps both")
    g.add_argument("--fp8-emulate", action="store_true", default=None,
                   help="--precision fp8 on a GPU without FP8 tensor cores: torchao's emulation (numerics, not speed; "
                        "a CPU always emulates)")
    g.add_argument("--scaling", help="strong (fixed global batch) or weak (fixed per-device batch)")
    g.add_argument("--lr-rule", help="none,linear,sqrt: LR scaling relative to --base-batch")
    g.add_argument("--batch", help="sequences per step: global (strong) or per device (weak); auto (weak scaling): "
                                   "the largest per device that fits, found by trial runs per cell")
    g.add_argument("--seq-len", help="tokens per sequence (default: the size's); a list sweeps them: 256,512,1024")
    g.add_argument("--steps", help="measured steps")
    g.add_argument("--warmup", help="unmeasured steps first")
    g.add_argument("--microbatches", help="pipeline microbatches (default 2 x pp)")
    g.add_argument("--pp-schedule", help=", ".join(PP_SCHEDULES) + " (zb: interleaved zero-bubble, two stages per "
                                         "rank); a list sweeps them across the pipelined strategies")
    g.add_argument("--grad-accum", help="gradient-accumulation micro-steps (non-pipeline)")
    g.add_argument("--base-lr", help="LR at --base-batch")
    g.add_argument("--base-batch", help="global batch at which --base-lr holds (default: --batch)")
    g.add_argument("--warmup-steps", help="linear LR warmup steps (Goyal et al. 2017)")
    g.add_argument("--seed")
    g.add_argument("--target-loss", help="loss for steps-to-target (default: entropy floor + 0.5 nats)")
    g.add_argument("--degrees", help="explicit degrees overriding the presets, e.g. pp=2,tp=2")
    g.add_argument("--compile", help="off,on: torch.compile per transformer block (default off)")
    g.add_argument("--ac", help="activation checkpointing policies: none (default), attn (the attention core; "
                                "'selective' before), op (per-op: keep attention and every other matmul), layerN "
                                "(every N-th block whole, e.g. layer2), full (every block)")
    g.add_argument("--optimizer", help="adamw (torch's default kernel) or adamw-fused (default adamw)")
    g.add_argument("--checkpoint", help="off,sync,async,async-pinned: save the model and optimizer state through "
                   "torch.distributed.checkpoint every --checkpoint-every measured steps; sync waits for the write, "
                   "async for the staging only, async-pinned stages into pinned host memory (GPUs) (default off); "
                   "each mode a cell")
    g.add_argument("--checkpoint-every", help="measured steps between checkpoint saves (default 5)")
    g.add_argument("--checkpoint-keep", action="store_true", default=None,
                   help="keep each cell's saves in its folder (cells/<id>/checkpoints/step-NNNNNN) with its loss curve, "
                        "for --restore-from")
    g.add_argument("--restore-from", metavar="STEP_DIR",
                   help="start every cell from this save of another run (a step-NNNNNN folder kept by "
                        "--checkpoint-keep), resharded into the cell's layout; its losses are held against the source's")
    g.add_argument("--device", default=None,
                   help=f"auto (default), cpu or cuda; harness plan also takes a hardware preset "
                        f"({', '.join(DEVICES)}) or a device file for a what-if prediction")
    g.add_argument("--nvtx", choices=("on", "off"), default=None, help="NVTX ranges (default on)")
    g.add_argument("--monitor-hz", help="GPU (NVML) or host sampling rate over the measured window, Hz "
                                        "(default 10; 0: no monitor thread, the record says so)")
    g.add_argument("--profile", action="store_true", default=None, help="torch.profiler traces per rank")
    g.add_argument("--mem-cap-gib", help="CPU: cap each rank's memory growth; over it the cell is oom")
    g.add_argument("--no-reference", action="store_true", default=None,
                   help="do not add the single-device reference cell used for parity")
    g.add_argument("--force", action="store_true", default=None,
                   help="run cells the model predicts will not fit in a rank's memory (invalid otherwise)")
    g.add_argument("--nnodes", help="machines in the job (torchrun rendezvous at --rdzv-endpoint, node rank 0 hosts it)")


def actions_of(add: Callable[[argparse.ArgumentParser], None]) -> list[argparse.Action]:
    """The argparse actions ``add`` puts on a parser (argparse has no public list of a parser's actions)."""
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    return [a for a in parser._actions if a.dest != "help"]


def sweep_actions() -> list[argparse.Action]:
    """The sweep-matrix flags' argparse actions."""
    return actions_of(add_sweep_args)


def sweep_arg_values(args: argparse.Namespace) -> dict:
    """The sweep-matrix flags that are set in ``args``, by dest."""
    return {a.dest: getattr(args, a.dest) for a in sweep_actions() if getattr(args, a.dest, None) is not None}


class Settings(dict):
    """Merged settings (CLI > sweep file > defaults) that remember which keys the sweep file gave,
    so an error names the file's key, not a flag the user never typed."""

    def __init__(self, values: dict, file: Path | None = None, from_file: frozenset[str] = frozenset()) -> None:
        super().__init__(values)
        self.file = file
        self.from_file = from_file

    def label(self, key: str) -> str:
        """``--seq-len`` for a flag or default, ``FILE: seq_len`` for a sweep file's key."""
        return f"{self.file}: {key}" if key in self.from_file else f"--{key.replace('_', '-')}"


WHATIF_KEYS = ("recompute", "efficiency", "error_from", "device_mem", "power_cap")
"""Keys a sweep file may also hold for ``harness plan --device PRESET``."""


def _read_sweep_file(path: Path, known: set[str], switches: frozenset[str] = frozenset()) -> dict:
    """A sweep file's keys as flag dests, each value as a flag's text. ``switches`` are the on/off flags (``--force``):
    their keys take a TOML boolean only (``force = "no"`` would read as on); every other key a value or a flat list
    of values (a list is its comma list)."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"--sweep {path}: not UTF-8 text (byte {e.start}); a sweep file is TOML, fix the file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--sweep {path}: cannot read TOML ({e}); fix the file") from None
    values: dict[str, object] = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in known:
            close = difflib.get_close_matches(dest, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(known))}"
            raise UsageError(f"unknown key {key!r} in {path}; {hint}")
        if dest in switches:
            if not isinstance(value, bool):
                raise UsageError(f"{path}: {key} = {value!r} is an on/off switch; write {key} = true or {key} = false")
            values[dest] = value or None  # false: as if not given (the flag's own default)
            continue
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(x, dict | list | bool) for x in items):
            raise UsageError(f"{path}: {key} = {value!r}: give a value or a flat list of values (a switch's words "
                             f"quoted, e.g. compile = \"on\"), e.g. {key} = [1, 2]")
        text = ",".join(map(str, items))  # as a flag's text: every value goes through the flags' one check
        if "\x00" in text:
            raise UsageError(f"{path}: {key} holds a NUL character; fix the file")
        values[dest] = text
    return {k: v for k, v in values.items() if v is not None}


def merged(args: argparse.Namespace) -> Settings:
    """CLI > sweep file > defaults. A sweep file's unknown key is an error, with the closest valid key."""
    file_vals: dict = {}
    path = getattr(args, "sweep", None)
    if path:
        known = {a.dest for a in sweep_actions()} - {"sweep"}
        known |= {k for k in WHATIF_KEYS if hasattr(args, k)}
        switches = frozenset(a.dest for a in sweep_actions() if a.nargs == 0)
        file_vals = _read_sweep_file(path, known, switches)
    cli = {k: v for k, v in vars(args).items() if v is not None}
    return Settings({**file_vals, **cli}, path, frozenset(k for k in file_vals if k not in cli))


def check_batch_auto(v: Settings, device: str) -> None:
    """``--batch auto`` searches the batch per device: weak scaling, an LR base, a memory limit on CPU."""
    scalings = csv_list(v.get("scaling", "strong"))
    if scalings != ("weak",):
        raise UsageError(f"{v.label('batch')} auto with --scaling {','.join(scalings)}: auto finds the batch per "
                         f"device, and strong scaling holds the global batch fixed for every strategy and its "
                         f"parity reference; use --scaling weak, or a fixed --batch")
    if any(r != "none" for r in csv_list(v.get("lr_rule", "none"))) and "base_batch" not in v:
        raise UsageError(f"{v.label('batch')} auto with an LR rule needs --base-batch (the global batch at which "
                         f"--base-lr holds), since the batch is not known before the search")
    if device == "cpu" and "mem_cap_gib" not in v:
        raise UsageError(f"{v.label('batch')} auto on CPU needs --mem-cap-gib (a rank's memory limit): CPU ranks "
                         f"share the host's RAM and would swap long before they ran out of memory")


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    v = merged(args)
    device = v.get("device", "auto")
    if device not in RUN_DEVICES:
        hint = (f"{device!r} is a hardware preset: harness plan --device {device} predicts from it; "
                if str(device).lower() in DEVICES else f"{device!r}: ")
        raise UsageError(f"--device {hint}runs need auto, cpu or cuda")
    if device == "auto":
        device = default_device_kind()
    elif device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    d = DEFAULTS[device]
    gpus = ints(v.label("gpus"), v.get("gpus", 1))
    auto = str(v.get("batch", "")).strip() == "auto"
    if auto:
        check_batch_auto(v, device)
    # Several devices: every multi-device strategy; the planner adds the single-device reference.
    strategies = (listed(v.label("strategies"), v["strategies"], "ddp,fsdp") if "strategies" in v else
                  ("single",) if max(gpus) == 1 else tuple(s for s in STRATEGIES if s != "single"))
    compiles = tuple(x == "on" for x in choices(v.label("compile"), v.get("compile", "off"), COMPILE_MODES))
    schedules = choices(v.label("pp_schedule"), v.get("pp_schedule", "1f1b"), PP_SCHEDULES)
    check_schedule_compile(schedules, compiles)
    check_schedule_ac(schedules, policies_arg(v.label("ac"), v.get("ac", "none")))
    if v.get("checkpoint_keep") and checkpoints_arg(v, device) == ("off",):
        raise UsageError("--checkpoint-keep keeps saves, and --checkpoint is off: add --checkpoint sync (or async), "
                         "or drop --checkpoint-keep")
    models = models_arg(v, device)
    spec = SweepSpec(
        models=models,
        sizes=listed(v.label("sizes"), v.get("sizes", d["sizes"]), "tiny,small"),
        strategies=strategies,
        precisions=listed(v.label("precision"), v.get("precision", d["precision"]), "fp32,bf16"),
        gpus=gpus,
        device_kind=device,
        batch=1 if auto else int_arg(v.label("batch"), v.get("batch", d["batch"]), 1),
        batch_auto=auto,
        steps=int_arg(v.label("steps"), v.get("steps", d["steps"]), 1),
        warmup=int_arg(v.label("warmup"), v.get("warmup", d["warmup"]), 0),
        scalings=listed(v.label("scaling"), v.get("scaling", "strong"), "strong,weak"),
        lr_rules=listed(v.label("lr_rule"), v.get("lr_rule", "none"), "none,linear,sqrt"),
        compiles=compiles,
        acs=policies_arg(v.label("ac"), v.get("ac", "none")),
        optimizers=choices(v.label("optimizer"), v.get("optimizer", "adamw"), OPTIMIZERS),
        archs=choices(v.label("arch"), v.get("arch", DEFAULT_ARCH), ARCHS),
        seq_lens=seq_lens_arg(v.label("seq_len"), v["seq_len"]) if "seq_len" in v else (None,),
        moe_routings=choices(v.label("moe_routing"), v.get("moe_routing", "learned"), ROUTINGS),
        sequence_parallels=tuple(x == "on" for x in choices(v.label("sp"), v.get("sp", "on"), SP_MODES)),
        fp8_recipes=choices(v.label("fp8_recipe"), v.get("fp8_recipe", "tensorwise"), FP8_RECIPES),
        fp8_all_gathers=tuple(x == "on" for x in choices(v.label("fp8_all_gather"), v.get("fp8_all_gather", "off"),
                                                         COMPILE_MODES)),
        fp8_emulate=bool(v.get("fp8_emulate", False)),
        checkpoints=checkpoints_arg(v, device),
        checkpoint_every=int_arg(v.label("checkpoint_every"), v.get("checkpoint_every", 5), 1),
        checkpoint_keep=bool(v.get("checkpoint_keep", False)),
        restore_from=restore_from_arg(v),
        microbatches=int_arg(v.label("microbatches"), v["microbatches"], 1) if "microbatches" in v else None,
        pp_schedules=schedules,
        grad_accum=int_arg(v.label("grad_accum"), v.get("grad_accum", 1), 1),
        base_lr=positive_float(v.label("base_lr"), v.get("base_lr", 1e-3)),
        base_batch=int_arg(v.label("base_batch"), v["base_batch"], 1) if "base_batch" in v else None,
        lr_warmup_steps=int_arg(v.label("warmup_steps"), v.get("warmup_steps", 0), 0),
        seed=int_arg(v.label("seed"), v.get("seed", 0), 0),
        target_loss=positive_float(v.label("target_loss"), v["target_loss"]) if "target_loss" in v else None,
        nnodes=int_arg(v.label("nnodes"), v.get("nnodes", 1), 1),
        nvtx=v.get("nvtx", "on") == "on",
        monitor_hz=rate_value(v.label("monitor_hz"), v.get("monitor_hz", 10.0)),
        profile=bool(v.get("profile", False)),
        mem_cap_gib=positive_float(v.label("mem_cap_gib"), v["mem_cap_gib"]) if "mem_cap_gib" in v else None,
        degrees=degrees_arg(v.get("degrees")),
        reference=not v.get("no_reference", False),
        force=bool(v.get("force", False)),
    )
    check_applies(v, spec)
    return spec


def check_applies(v: Settings, spec: SweepSpec) -> None:
    """A flag given for a part no strategy or precision of the sweep has is refused, never silently dropped."""
    strategies = ", ".join(spec.strategies)
    degrees = spec.degrees or {}
    has = {
        "a pipeline (pp, pp+fsdp, ...)": degrees.get("pp", 1) > 1 or any(s in PP_PRESETS for s in spec.strategies),
        "tensor parallel (tp, fsdp+tp, ...)": degrees.get("tp", 1) > 1 or any(
            "tp" in s.split("+") or s == "tp-sp" for s in spec.strategies),
    }
    needs = {"pp_schedule": "a pipeline (pp, pp+fsdp, ...)", "microbatches": "a pipeline (pp, pp+fsdp, ...)",
             "sp": "tensor parallel (tp, fsdp+tp, ...)"}
    for key, part in needs.items():
        if key in v and not has[part]:
            raise UsageError(f"{v.label(key)} {v[key]!r}: no strategy of this sweep ({strategies}) has {part}; add "
                             f"one to --strategies, or drop {v.label(key)}")
    for key in ("fp8_recipe", "fp8_all_gather", "fp8_emulate"):
        if key in v and "fp8" not in spec.precisions:
            raise UsageError(f"{v.label(key)} {v[key]!r} sets up --precision fp8, and this sweep's precisions are "
                             f"{', '.join(spec.precisions)}; add fp8 to --precision, or drop {v.label(key)}")
    if "checkpoint_every" in v and spec.checkpoints == ("off",):
        raise UsageError(f"{v.label('checkpoint_every')} {v['checkpoint_every']!r}: --checkpoint is off, so nothing "
                         f"is saved; add --checkpoint sync (or async), or drop {v.label('checkpoint_every')}")


def device_line(spec: SweepSpec) -> str:
    """The run's first line: which device kind the cells run on, and what --gpus means there."""
    if spec.device_kind == "cpu":
        what = (f"models {','.join(m.name for m in spec.models)}" if spec.models
                else f"CPU-sized defaults (sizes {','.join(spec.sizes)})")
        line = f"device: cpu (no GPU in use): --gpus {','.join(map(str, spec.gpus))} means CPU ranks on gloo; {what}"
    else:
        line = f"device: cuda ({torch.cuda.get_device_name()}), NCCL"
    return "\n".join([line, *model_notes(spec.models)])


