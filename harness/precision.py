"""Precision modes: one required, recorded field per cell, never inferred from the hardware.

* ``fp32``: full fp32, TF32 matmuls off.
* ``tf32``: fp32 storage, TF32 tensor-core matmuls (GPU only).
* ``bf16``: autocast to bfloat16; master weights, optimizer and reductions in fp32.
* ``fp16``: autocast to float16 plus dynamic loss scaling (``torch.amp.GradScaler``).
* ``fp8``: the linears train in float8 through torchao (``convert_to_float8_training``, dynamic
  tensor-wise scaling; the LM head and any linear whose dims are not multiples of 16 stay out),
  everything else as ``bf16``. GPUs of compute capability >= 8.9 with torchao only: elsewhere
  the cell is ``invalid`` with the reason (:func:`fp8_unavailable`), never a silent bf16 run.

Under FSDP2 the mode also maps onto ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=fp32)``:
parameters are gathered in low precision, gradients reduced in fp32; autocast stays on so
op-level precision (e.g. LayerNorm and softmax in fp32) is the same as under every other strategy.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass

import torch

from harness.errors import UsageError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""


@dataclass(frozen=True)
class PrecisionPlan:
    mode: str

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
            why = fp8_unavailable(device_kind)
            if why is not None:
                raise UsageError(why)

    def convert_linears(self, module: torch.nn.Module) -> None:
        """``fp8``: swap the eligible linears for torchao's float8 training linears; else nothing."""
        if self.mode == "fp8":
            from torchao.float8 import convert_to_float8_training  # noqa: PLC0415  (optional extra, GPU only)

            convert_to_float8_training(module, module_filter_fn=_fp8_eligible)

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
        if data_parallel in ("fsdp", "hsdp"):
            low = self.autocast_dtype
            d["fsdp_mixed_precision"] = {
                "param_dtype": str(low).replace("torch.", "") if low else "float32",
                "reduce_dtype": "float32",
            }
        return d


def fp8_unavailable(device_kind: str) -> str | None:
    """Why float8 training cannot run here (one line naming the fix), or None when it can."""
    if device_kind != "cuda" or not torch.cuda.is_available():
        return ("precision fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9) and this run "
                "has none; use bf16")
    cap = torch.cuda.get_device_capability()
    if cap < FP8_MIN_CAPABILITY:
        return (f"precision fp8 needs compute capability >= 8.9 (FP8 tensor cores); {torch.cuda.get_device_name()} "
                f"is {cap[0]}.{cap[1]}; use bf16")
    if importlib.util.find_spec("torchao") is None:
        return "precision fp8 needs torchao, which is not installed: pip install '.[fp8]', or use bf16"
    try:
        importlib.import_module("torchao.float8")
    except (ImportError, RuntimeError, AttributeError) as e:  # a torchao built for another torch
        return (f"precision fp8: torchao is installed but torchao.float8 does not import with torch "
                f"{torch.__version__} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                f"install a torchao built for this torch, or use bf16")
    return None


def _fp8_eligible(module: torch.nn.Module, fqn: str) -> bool:
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
    if mode == "fp8" and "tp" in strategy.split("+") + strategy.split("-"):
        raise UsageError(f"precision fp8 with strategy {strategy}: tensor parallel needs torchao's float8 TP "
                         f"styles, which this harness does not apply; use fp8 with single, ddp, fsdp, zero2, hsdp "
                         f"or pp, or bf16 with {strategy}")
