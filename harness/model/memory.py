"""Memory per rank: model states (exact), activations and a predicted peak.

**Model states** (Rajbhandari et al. 2020, ZeRO section 3): this harness keeps fp32 master
parameters and fp32 gradients in every precision mode (AMP casts on the fly; FSDP gathers a
low-precision copy and frees it), and AdamW holds two fp32 moments plus a 4-byte ``step``
tensor per parameter tensor: ``16 bytes x (parameters this rank holds) + 4 x tensors``, where
"holds" is :mod:`harness.model.inventory`'s placement. ZeRO's mixed-precision count for a bf16
model with fp32 Adam (2 + 2 + 12) is also 16 bytes per parameter, so ZeRO-3 over ``n`` ranks
holds ``16 N / n``.

**Activations** (Korthikanti et al. 2022, section 4, adapted to this model: no dropout, fused
SDPA attention that saves its output and log-sum-exp instead of the ``5 a s^2 b`` score
matrices): per layer and token, the saved tensors are the two LayerNorm inputs and outputs
(``4 d``; sequence-parallel: the inputs ``/ tp``, the outputs whole, as the linears save them
all-gathered), q, k, v and the attention output (``4 d / tp``), the
MLP input to GELU and its output (``8 d / tp``): ``4 d + 12 d / tp`` elements. Recompute
``full`` keeps only each block's input (``d``) plus one block's activations during its
backward; ``selective`` recomputes the attention core, the q/k/v projections and SDPA
(:mod:`harness.parallel.levers`; drops q, k, v and the output: ``- 4 d / tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.model.inventory import (
    coords,
    fsdp_local_numel,
    fsdp_padded_numel,
    rank_layers,
    rank_params,
    tp_local_shape,
)
from harness.model.shape import CellShape

ADAM_STATE_BYTES = 8
"""exp_avg and exp_avg_sq in fp32."""
ADAM_STEP_BYTES = 4
"""AdamW's per-tensor ``step`` (a float32 scalar tensor)."""
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def state_bytes_by_rank(c: CellShape) -> list[StateBytes]:
    """Model-state bytes every global rank holds (fp32 params and grads, AdamW moments and steps)."""
    shard = c.dims.dp_shard if c.fsdp else 1
    priced: dict[tuple[int, int], StateBytes] = {}  # ranks that differ only in dp_replicate / tp hold alike
    out = []
    for k in coords(c.dims):
        key = (k.pp, k.dp_shard if shard > 1 else 0)
        if key not in priced:
            specs = rank_params(c.size, c.dims, c.virtual, k.pp)
            numel = sum(fsdp_local_numel(tp_local_shape(p, c.dims.tp), shard, k.dp_shard) for p in specs)
            priced[key] = StateBytes(params=4 * numel, grads=4 * numel,
                                     optimizer=ADAM_STATE_BYTES * numel + ADAM_STEP_BYTES * len(specs))
        out.append(priced[key])
    return out


def local_params(c: CellShape) -> int:
    """The most parameters any rank holds (elements)."""
    return max(s.params for s in state_bytes_by_rank(c)) // 4


def _layers_on_rank(c: CellShape) -> int:
    return max(rank_layers(c.size.n_layers, c.dims.pp, c.virtual, p) for p in range(c.dims.pp))


def inflight_microbatches(c: CellShape) -> int:
    """Microbatches whose activations a pipeline rank holds at once: all for GPipe, ``pp`` for 1F1B."""
    if not c.dims.pp_enabled:
        return 1
    if c.pp_schedule == "gpipe":
        return c.microbatches
    return min(c.microbatches, c.dims.pp)


def activation_bytes(c: CellShape) -> int:
    """Saved activations at the peak of one rank's step (the first stage, which holds the most)."""
    s, d, tp = c.size.seq_len, c.size.d_model, c.dims.tp
    rows = c.microbatch_rows
    lo, hi = c.compute_bytes, c.residual_bytes
    sp = tp if c.dims.sequence_parallel else 1
    # per token: LN in/out x2 (hi), q/k/v/attn-out and GELU in/out (lo, / tp). Under SP the LayerNorms
    # save their sequence-sharded inputs, but the column-parallel linears save the all-gathered
    # (full-sequence) LN outputs they consume: DTensor does not re-gather in backward as Megatron does.
    ln = 2 * d * hi / sp + 2 * d * hi
    per_layer = ln + 12 * d * lo / tp
    if c.recompute == "selective":
        per_layer -= 4 * d * lo / tp
    layers = _layers_on_rank(c)
    tokens = rows * s
    inflight = inflight_microbatches(c)
    if c.recompute == "full":  # every in-flight microbatch keeps its block inputs; one block is recomputed at a time
        return int(tokens * (inflight * layers * d * hi / sp + per_layer))
    return int(tokens * layers * per_layer * inflight)


def logits_bytes(c: CellShape) -> int:
    """Logits (compute dtype), their fp32 copy for the loss and its gradient, on the last stage."""
    rows = c.microbatch_rows
    v = c.size.vocab_size
    return int(rows * c.size.seq_len * v * (c.compute_bytes + 2 * 4))


def transient_param_bytes(c: CellShape) -> int:
    """Buffers beside the model states at the peak: DDP gradient buckets, FSDP gathered groups."""
    if c.data_parallel == "ddp":  # wrapped in DDP even at one replica
        return 4 * local_params(c)  # DDP's bucket copies of the gradients (gradient_as_bucket_view off)
    if not c.fsdp:
        return 0
    specs = rank_params(c.size, c.dims, c.virtual, 0)
    per_block = {}
    root = 0
    for p in specs:
        n = fsdp_padded_numel(tp_local_shape(p, c.dims.tp), c.dims.dp_shard) * c.param_bytes
        if p.layer is None:
            root += n
        else:
            per_block[p.layer] = per_block.get(p.layer, 0) + n
    blocks = sorted(per_block.values(), reverse=True)
    if c.reshard_after_forward:
        return root + sum(blocks[:2])  # current block and the prefetched next one
    return root + sum(blocks)


def peak_bytes(c: CellShape, base_bytes: float) -> float:
    """Predicted peak per rank: model states + transient buffers + activations + logits + base."""
    states = max(s.total for s in state_bytes_by_rank(c))
    return states + transient_param_bytes(c) + activation_bytes(c) + logits_bytes(c) / c.dims.tp + base_bytes
