"""What a checkpoint writes and what it costs a step at an interval, from the model states the model counts.

A save holds each rank's parameters and optimizer state (AdamW: fp32 parameters and two fp32 moments, 12 bytes
a parameter; gradients are not saved). ``torch.distributed.checkpoint`` writes a tensor replicated over data
parallel replicas once, so a rank's share is its states over the replicas. Save seconds are those bytes over a
write bandwidth per rank, which the what-if names as its assumption (no filesystem of the named hardware is
measured here); the measured CPU reference (results/reference/checkpoint-cpu-tiny-mini-w2-w4) holds the bytes.
"""

from __future__ import annotations

from harness.model.memory import state_bytes_by_rank
from harness.model.shape import CellShape

DEFAULT_WRITE_GBPS = 1.0
"""Write bandwidth per GPU the what-if assumes without ``--checkpoint-gbps`` (GB/s): a shared filesystem's share
per GPU is of this order; a node's local NVMe gives a few times more. Always printed beside the result."""


def checkpoint_bytes_by_rank(c: CellShape) -> list[float]:
    """Bytes each global rank writes per save: its parameters and optimizer state over the data-parallel replicas
    (DCP writes a replicated tensor once, the replicas sharing it)."""
    return [(b.params + b.optimizer) / c.dims.dp_replicate for b in state_bytes_by_rank(c)]


def save_seconds(c: CellShape, write_gbps: float) -> float:
    """A synchronous save's seconds: the busiest rank's bytes at ``write_gbps`` GB/s."""
    return max(checkpoint_bytes_by_rank(c)) / (write_gbps * 1e9)


def cost_per_step(save_s: float, every: int, step_s: float) -> float:
    """What one save in ``every`` steps of ``step_s`` seconds adds to each step, as a fraction of the step (the
    measured ``metrics.checkpoint.cost_per_step_pct`` is the same ratio of the blocking seconds)."""
    return save_s / (every * step_s)


def node_save_seconds(c: CellShape, node_write_gbps: float, nnodes: int = 1) -> float:
    """A synchronous save's seconds when a node's ranks share one filesystem of ``node_write_gbps`` GB/s (a
    node's local disk, as the calibration measured the run directory's): the busiest node's bytes over it."""
    per_rank = checkpoint_bytes_by_rank(c)
    per_node = len(per_rank) // max(1, nnodes)
    return max(sum(per_rank[i:i + per_node]) for i in range(0, len(per_rank), per_node)) / (node_write_gbps * 1e9)


def checkpoint_prediction(c: CellShape, storage: dict, nnodes: int = 1) -> dict:
    """``predicted.checkpoint`` of a cell that saves: bytes per rank, and the write's seconds at the bandwidth the
    calibration measured on the run directory's filesystem (``storage``: its entry)."""
    fp = storage.get("fingerprint") or {}
    return {"bytes_by_rank": checkpoint_bytes_by_rank(c), "write_gbps": storage["write_gbps"],
            "save_s": node_save_seconds(c, storage["write_gbps"], nnodes),
            "basis": f"write bandwidth of {fp.get('mount', '?')} ({fp.get('fstype', '?')}) measured {storage.get('measured_at')}"}
