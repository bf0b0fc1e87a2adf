"""Precision modes: one required, recorded field per cell, never inferred from the hardware.

* ``fp32``: full fp32, TF32 matmuls off.
* ``tf32``: fp32 storage, TF32 tensor-core matmuls (GPU only).
* ``bf16``: autocast to bfloat16; master weights, optimizer and reductions in fp32.
* ``fp16``: autocast to float16 plus dynamic loss scaling (``torch.amp.GradScaler``).

Under FSDP2 the mode also maps onto ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=fp32)``:
parameters are gathered in low precision, gradients reduced in fp32; autocast stays on so
op-level precision (e.g. LayerNorm and softmax in fp32) is the same as under every other strategy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from harness.errors import UsageError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
        low = self.autocast_dtype
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def grad_scaler(self, device_kind: str) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device_kind) if self.loss_scaling else None

    def describe(self, data_parallel: str) -> dict:
        d = {
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


def check_strategy(mode: str, strategy: str) -> None:
    """fp16 loss scaling needs every rank to agree on overflow; only implemented where grads are whole."""
    if mode == "fp16" and strategy not in ("single", "ddp"):
        raise UsageError(
            f"precision fp16 with strategy {strategy}: loss scaling over sharded or pipelined gradients is not "
            f"implemented (ranks would disagree on overflow); use bf16, or fp16 with single/ddp"
        )
