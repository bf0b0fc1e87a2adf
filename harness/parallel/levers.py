"""The levers a production run pulls: activation checkpointing, ``torch.compile``, fused AdamW.

Each is a typed choice of the cell, applied per transformer block by :func:`parallelize` in
torchtitan's order (pipeline split -> TP -> AC -> compile -> FSDP/DDP), so the
block's own submodule hooks (TP's) sit inside the checkpointed, compiled region and the data
parallel hooks (FSDP's per-block unshard) outside it. Both AC and compile replace the block's
``forward`` on the instance, never the module tree, so parameter names (and every record,
probe and parity check keyed by them) are the same with a lever on or off.

* ``ac``: activation checkpointing, a policy (:mod:`harness.parallel.activation_checkpoint`).
* ``compile on``: ``torch.compile`` of each block's forward (default inductor backend).
* ``optimizer adamw-fused``: ``torch.optim.AdamW(fused=True)``; ``adamw`` is torch's default
  implementation (for-each over CUDA tensors, the per-tensor loop on CPU), as every cell ran before.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from harness.errors import UsageError
from harness.records.record import FINGERPRINT_LEVERS
from workloads.model import Decoder
from workloads.own_model import OwnModule

COMPILE_MODES = ("off", "on")
OPTIMIZERS = ("adamw", "adamw-fused")
LEVER_DEFAULTS = FINGERPRINT_LEVERS
"""Cell fields of the levers and their values when not pulled (records without them mean these)."""


def apply_compile(part: Decoder | OwnModule) -> None:
    """``torch.compile`` each block's forward (the instance's, so checkpointing is compiled with it)."""
    for _, block in part.block_items():
        block.forward = torch.compile(block.forward)


def build_optimizer(params: list[torch.nn.Parameter], kind: str, lr: float) -> torch.optim.Optimizer:
    """The cell's AdamW (betas 0.9/0.95, no weight decay): torch's default kernel choice, or fused."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; choose from {', '.join(OPTIMIZERS)}")
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (1 s of imports the planning parent never needs)

    fused = {"fused": True} if kind == "adamw-fused" else {}
    # One group per tensor kind: a multi-tensor kernel takes DTensors or plain tensors, never both
    # (under TP the embeddings and LayerNorms stay plain tensors beside the DTensor linears).
    plain = [p for p in params if not isinstance(p, DTensor)]
    dtensors = [p for p in params if isinstance(p, DTensor)]
    groups = [{"params": g} for g in (plain, dtensors) if g]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)


CXX_COMPILERS = ("c++", "g++", "clang++")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (``$CXX`` first), or None."""
    for name in (os.environ.get("CXX"), *CXX_COMPILERS):
        if name and shutil.which(name):
            return name
    return None


def check_levers(device_kind: str, tp_enabled: bool, warmup: int, compile: bool, ac: str, optimizer: str) -> None:
    """Refuse, at plan time, a lever the cell's device or layout cannot run (UsageError naming why).
    Unknown values never get here: the CLI (``choices``) and :class:`~harness.spec.CellConfig` refuse them."""
    if not compile:
        return
    if device_kind == "cpu" and cxx_compiler() is None:
        raise UsageError(f"compile on: inductor needs a C++ compiler on CPU and none of {', '.join(CXX_COMPILERS)} "
                         f"is on PATH (nor $CXX); install one (apt install g++) or use --compile off")
    if device_kind == "cuda" and importlib.util.find_spec("triton") is None:
        raise UsageError("compile on: inductor needs triton on CUDA and it is not installed; "
                         "pip install triton, or use --compile off")
    if ac != "none" and tp_enabled:
        raise UsageError(f"compile on with ac {ac} under tensor parallel: torch's AOT autograd cannot save the "
                         f"DeviceMesh a checkpointed DTensor block keeps (AssertionError: expected all "
                         f"tensors_saved_with_vc_check to be Tensors); use --ac none with compile, or --compile off")
    if warmup < 1:
        raise UsageError(f"compile on with --warmup {warmup}: compilation happens in the first steps and must "
                         f"never enter the measured ones; use --warmup >= 1")
