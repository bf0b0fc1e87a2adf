"""Precision modes: one required, recorded field per cell, never inferred from the hardware.

* ``fp32``: full fp32, TF32 matmuls off.
* ``tf32``: fp32 storage, TF32 tensor-core matmuls (GPU only).
* ``bf16``: autocast to bfloat16; master weights, optimizer and reductions in fp32.
* ``fp16``: autocast to float16 plus dynamic loss scaling (``torch.amp.GradScaler``).
* ``fp8``: the linears train in float8 through torchao (``convert_to_float8_training``; the LM head
  and any linear whose dims are not multiples of 16 stay out), everything else as ``bf16``. The scaling
  recipe is torchao's (:data:`FP8_RECIPES`: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``); under
  FSDP2 the converted weights can be all-gathered in float8 (tensorwise, their scales precomputed once
  per step). GPUs of compute capability >= 8.9 run it for real; a CPU runs torchao's emulation (the
  float8 casts and scales are real, the matmuls bf16), a numerics and plumbing check whose throughput
  is labelled emulated and never enters MFU; a GPU without FP8 tensor cores is ``invalid`` unless
  emulation is asked for (``--fp8-emulate``). Never a silent bf16 run (:func:`fp8_unavailable`).

Under FSDP2 the mode also maps onto ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=fp32)``:
parameters are gathered in low precision, gradients reduced in fp32; autocast stays on so
op-level precision (e.g. LayerNorm and softmax in fp32) is the same as under every other strategy.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.errors import UsageError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): one scale per tensor; one per
row of each operand; rowwise with the weight gradient's matmul in high precision (bf16)."""


@dataclass(frozen=True)
class Fp8Options:
    """How a ``--precision fp8`` cell trains its float8 linears (defaults for every other precision)."""

    recipe: str = "tensorwise"
    all_gather: bool = False
    """FSDP2 gathers the converted weights in float8 (tensorwise only), their scales precomputed after each
    optimizer step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
    emulate: bool = False
    """torchao's emulation: the casts and scales as on FP8 hardware, the matmuls in high precision."""

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise UsageError(f"unknown fp8 recipe {self.recipe!r}; choose from {', '.join(FP8_RECIPES)}")


@dataclass(frozen=True)
class PrecisionPlan:
    mode: str
    fp8: Fp8Options = Fp8Options()

    def __post_init__(self) -> None:
        if self.mode not in PRECISIONS:
            raise UsageError(f"unknown precision {self.mode!r}; choose from {', '.join(PRECISIONS)}")

    @property
    def compute_dtype(self) -> str:
        """The dtype matmuls run in, the key of the datasheet peak table."""
        return self.mode

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _LOW.get(self.mode)

    @property
    def loss_scaling(self) -> bool:
        return self.mode == "fp16"

    def check_device(self, device_kind: str) -> None:
        if self.mode == "tf32" and device_kind != "cuda":
            raise UsageError("precision tf32 needs a CUDA GPU (TF32 is a tensor-core format); use fp32 or bf16 on CPU")
        if self.mode == "fp8":
            why = fp8_unavailable(device_kind, self.fp8.emulate)
            if why is not None:
                raise UsageError(why)

    def convert_linears(self, module: torch.nn.Module) -> list[str]:
        """``fp8``: swap the eligible linears for torchao's float8 training linears (their names, returned);
        else nothing."""
        if self.mode != "fp8":
            return []
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415 (optional extra)

        config = replace(Float8LinearConfig.from_recipe_name(self.fp8.recipe), emulate=self.fp8.emulate,
                         enable_fsdp_float8_all_gather=self.fp8.all_gather)
        convert_to_float8_training(module, config=config, module_filter_fn=fp8_eligible)
        return [name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"]

    def after_optimizer_step(self, parts: list[torch.nn.Module]) -> Callable[[], None] | None:
        """What runs after each optimizer step: FSDP's float8 all-gather needs the next step's weight scales,
        computed here in one all-reduce of amaxes (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
        if self.mode != "fp8" or not self.fp8.all_gather:
            return None
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415 (optional extra)

        def precompute() -> None:
            for part in parts:
                precompute_float8_dynamic_scale_for_fsdp(part)

        return precompute

    def configure_backends(self, device_kind: str) -> None:
        """TF32 on only for tf32; off otherwise so fp32 means fp32."""
        if device_kind == "cuda":
            on = self.mode == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = on
            torch.backends.cudnn.allow_tf32 = on

    def autocast(self, device_kind: str):
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_kind, dtype=dtype)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415 (DTensor's imports: ranks only)

        low = self.autocast_dtype
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def grad_scaler(self, device_kind: str) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device_kind) if self.loss_scaling else None

    def describe(self, data_parallel: str) -> dict:
        d: dict[str, object] = {
            "mode": self.mode,
            "autocast_dtype": str(self.autocast_dtype).replace("torch.", "") if self.autocast_dtype else None,
            "master_weights": "float32",
            "loss_scaling": "dynamic GradScaler" if self.loss_scaling else None,
            "tf32_matmul": self.mode == "tf32",
        }
        if self.mode == "fp8":
            d["fp8"] = {"recipe": self.fp8.recipe, "emulated": self.fp8.emulate, "float8_all_gather": self.fp8.all_gather}
        if data_parallel in ("fsdp", "hsdp"):
            low = self.autocast_dtype
            d["fsdp_mixed_precision"] = {
                "param_dtype": str(low).replace("torch.", "") if low else "float32",
                "reduce_dtype": "float32",
            }
        return d


def fp8_unavailable(device_kind: str, emulate: bool = False) -> str | None:
    """Why float8 training cannot run here (one line naming the fix), or None when it can: on FP8 tensor cores,
    or emulated (a CPU always emulates; a GPU without FP8 tensor cores when ``emulate``)."""
    if device_kind == "cuda" and not emulate:
        if not torch.cuda.is_available():
            return ("precision fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9) and this run "
                    "has none; use bf16, or --device cpu to run torchao's emulation")
        cap = torch.cuda.get_device_capability()
        if cap < FP8_MIN_CAPABILITY:
            return (f"precision fp8 needs compute capability >= 8.9 (FP8 tensor cores); {torch.cuda.get_device_name()} "
                    f"is {cap[0]}.{cap[1]}; use bf16, or --fp8-emulate for torchao's emulation (numerics, not speed)")
    if importlib.util.find_spec("torchao") is None:
        return "precision fp8 needs torchao, which is not installed: pip install '.[fp8]', or use bf16"
    try:
        importlib.import_module("torchao.float8")
    except (ImportError, RuntimeError, AttributeError) as e:  # a torchao built for another torch
        return (f"precision fp8: torchao is installed but torchao.float8 does not import with torch "
                f"{torch.__version__} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                f"install a torchao built for this torch, or use bf16")
    return None


def float8_tp_styles(device_kind: str) -> bool:
    """Whether tensor parallel takes torchao's float8 styles (activations all-gathered in float8): on NCCL. gloo
    cannot all-gather a float8 tensor (``RuntimeError: Invalid scalar type``, measured with torch 2.13), so CPU
    ranks keep torch's styles: bf16 activations gathered, then cast in each float8 linear."""
    return device_kind == "cuda"


def fp8_observed(parts: list[torch.nn.Module]) -> dict[str, list]:
    """What the float8 linears of ``parts`` were built with, read off the modules (a claim's evidence): the
    recipes whose casts their configs carry (torchao's ``Float8LinearConfig.from_recipe_name``; ``unknown`` for a
    config no recipe gives) and their float8 all-gather switch. Empty lists where no linear is float8."""
    configs: list[Any] = [m.config for p in parts for m in p.modules() if type(m).__name__ == "Float8Linear"]
    if not configs:
        return {"recipes": [], "float8_all_gather": []}
    from torchao.float8 import Float8LinearConfig  # noqa: PLC0415 (optional extra; only where a linear is float8)

    casts = ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
             "cast_config_weight_for_grad_input", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight")

    def recipe(c) -> str:
        return next((r for r in FP8_RECIPES if all(getattr(c, k) == getattr(Float8LinearConfig.from_recipe_name(r), k)
                                                   for k in casts)), "unknown")

    return {"recipes": sorted({recipe(c) for c in configs}),
            "float8_all_gather": sorted({bool(c.enable_fsdp_float8_all_gather) for c in configs})}


def fp8_eligible(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's float8 matmuls need both dims divisible by 16; the LM head stays bf16 (as torchtitan)."""
    return (isinstance(module, torch.nn.Linear) and fqn.split(".")[-1] != "head"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def check_strategy(mode: str, strategy: str) -> None:
    """fp16 loss scaling needs every rank to agree on overflow; only implemented where grads are whole."""
    if mode == "fp16" and strategy not in ("single", "ddp"):
        raise UsageError(
            f"precision fp16 with strategy {strategy}: loss scaling over sharded or pipelined gradients is not "
            f"implemented (ranks would disagree on overflow); use bf16, or fp16 with single/ddp"
        )


def check_fp8(fp8: Fp8Options, *, fsdp: bool, tp: bool, device_kind: str = "cuda") -> None:
    """The fp8 options a layout can take: torchao's float8 TP styles and FSDP's float8 all-gather are tensorwise
    (one scale per tensor, which a shard can hold); the high-precision weight gradient needs bf16 parameters
    (FSDP's param_dtype): under plain autocast torchao's weight-gradient matmul mixes bf16 and fp32 (measured:
    "expected m1 and m2 to have the same dtype")."""
    if fp8.all_gather and not fsdp:
        raise UsageError("--fp8-all-gather on gathers FSDP's parameters in float8, and this layout has no FSDP; "
                         "use it with fsdp, hsdp or a +fsdp hybrid")
    if fp8.recipe != "tensorwise" and (fp8.all_gather or tp):
        what = "FSDP's float8 all-gather" if fp8.all_gather else "torchao's float8 tensor-parallel styles"
        raise UsageError(f"fp8 recipe {fp8.recipe}: {what} take the tensorwise recipe only (one scale per tensor); "
                         f"use --fp8-recipe tensorwise for this layout")
    if fp8.all_gather and tp and not float8_tp_styles(device_kind):
        raise UsageError("--fp8-all-gather on with tensor parallel gathers float8 DTensor shards, which needs torchao's "
                         "float8 TP styles, and gloo cannot move float8 tensors (CPU ranks; measured: NotImplementedError "
                         "aten.view_as); run it on NCCL, or --fp8-all-gather off on CPU")
    if fp8.recipe == "rowwise_with_gw_hp" and not fsdp:
        raise UsageError("fp8 recipe rowwise_with_gw_hp computes the weight gradient from bf16 parameters, which "
                         "only FSDP's param_dtype gives; use it with an fsdp layout, or --fp8-recipe rowwise")
