"""The facts of a cell the model needs, from a :class:`~harness.spec.CellConfig` or a what-if."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

from harness.parallel.activation_checkpoint import ac_policy
from harness.parallel.dims import ParallelDims
from harness.parallel.presets import Layout
from harness.parallel.schedules import V_SCHEDULES
from workloads.sizes import ModelSize

if TYPE_CHECKING:  # for annotations only: harness.spec imports torch, which the model never needs
    from harness.spec import CellConfig

LOW_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes of an activation element; fp8 keeps its activations in bf16 (torchao casts at each matmul)."""


@dataclass(frozen=True)
class CellShape:
    size: ModelSize
    """The workload at the cell's sequence length (the position table follows it)."""
    dims: ParallelDims
    strategy: str
    precision: str
    global_batch: int
    grad_accum: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    device_kind: str = "cpu"
    recompute: str = "none"
    """The activation checkpointing policy (:mod:`harness.parallel.activation_checkpoint`)."""
    fake_compute: bool = False
    """``harness fit``'s fake compute (FakeTensorMode), which runs SDPA as the fused GPU kernel it stands for
    (:func:`harness.fit.role_process._fused_attention`) even on a CPU."""
    moe_imbalance: float = 1.0
    """The busiest expert's load over the mean (a record's ``metrics.moe.imbalance_max_over_mean``; 1: balanced).
    Under expert parallel the rank holding it computes that much more of the experts' FLOPs."""
    optimizer: str = "adamw"
    """``adamw`` (torch's default kernel: on CPU ranks one tensor at a time) or ``adamw-fused``."""
    fp8_all_gather: bool = False
    """``--precision fp8 --fp8-all-gather on``: FSDP gathers the float8 linears' weights at 1 byte an element."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", ac_policy(self.recompute))  # a policy's earlier name as today's

    @classmethod
    def of(cls, cfg: CellConfig) -> CellShape:
        """From a planned :class:`~harness.spec.CellConfig` (a module of your own stands in for a size where only its
        tensors are read: :func:`harness.model.predict._own_prediction`)."""
        size = cast(ModelSize, cfg.model_size)
        dims = cfg.layout.dims
        return cls(size=size, dims=dims, strategy=cfg.strategy, precision=cfg.precision,
                   global_batch=cfg.global_batch, grad_accum=cfg.grad_accum, microbatches=cfg.microbatches,
                   pp_schedule=cfg.pp_schedule, device_kind=cfg.device_kind, recompute=cfg.ac,
                   optimizer=cfg.optimizer, fp8_all_gather=cfg.fp8_all_gather)

    def at_layer(self, layer: int) -> CellShape:
        """The cell as if every block were block ``layer`` (:meth:`workloads.architecture.ModelSize.at_layer`): what
        a per-block formula reads where an MoE model's first blocks are dense."""
        size = self.size.at_layer(layer)
        return self if size is self.size else replace(self, size=size)

    @property
    def layout(self) -> Layout:
        """The strategy's resolved layout: the one rule for FSDP and data-parallel sync."""
        return Layout(self.strategy, self.dims)

    @property
    def data_parallel(self) -> str:
        return self.layout.data_parallel

    @property
    def fsdp(self) -> bool:
        """Whether ``fully_shard`` is applied (:attr:`harness.parallel.presets.Layout.fsdp`)."""
        return self.layout.fsdp

    @property
    def reshard_after_forward(self) -> bool:
        return self.layout.reshard_after_forward

    @property
    def virtual(self) -> int:
        return self.layout.virtual_stages(self.pp_schedule)

    @property
    def v_shape(self) -> bool:
        """Whether a pipeline rank holds its two stages in a V (zbv, dualpipev), not looped."""
        return self.dims.pp_enabled and self.pp_schedule in V_SCHEDULES

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel rank per optimizer step."""
        return self.global_batch // self.dims.dp

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence a rank holds: the whole sequence, or ``1 / cp`` of it under context parallel."""
        return self.size.seq_len // self.dims.cp

    @property
    def microbatch_rows(self) -> int:
        """Sequences per pipeline microbatch (or per accumulation micro-step without a pipeline)."""
        return self.local_batch // (self.microbatches if self.dims.pp_enabled else self.grad_accum)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul outputs: the autocast dtype, else fp32."""
        return LOW_BYTES[self.precision]

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream, LayerNorm outputs and their gradients.

        fp32 under autocast (LayerNorm and the residual add run in fp32), except under FSDP with
        a low-precision ``param_dtype``: ``MixedPrecisionPolicy`` casts each group's forward
        inputs to it, so the whole stream is low precision.
        """
        return self.param_bytes if self.fsdp else 4

    @property
    def param_bytes(self) -> int:
        """Bytes per element FSDP gathers: ``MixedPrecisionPolicy.param_dtype`` (low precision under AMP)."""
        return LOW_BYTES[self.precision]
