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

**Context parallel** (:mod:`harness.parallel.cp`): a rank holds ``1 / cp`` of each sequence's tokens,
so every per-token term above falls by ``cp``, but each layer's attention saves the *gathered* keys
and values of the whole sequence (SDPA keeps its inputs): per local token ``2 kv_dim cp / tp`` in place
of the local ``2 kv_dim / tp``. Those K/V buffers are what stops activations falling as ``1 / cp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.model.block_ops import block_matmuls, kept_by_op
from harness.model.inventory import (
    coords,
    fsdp_padded_numel,
    fsdp_ways,
    held_numel,
    held_shape,
    rank_layer_ids,
    rank_params,
    stages_of_rank,
)
from harness.model.pipeline_sim import live_peak, schedule_order
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import checkpointed_layer
from harness.parallel.schedules import layer_ranges

ADAM_STATE_BYTES = 8
"""exp_avg and exp_avg_sq in fp32."""
ADAM_STEP_BYTES = 4
"""AdamW's per-tensor ``step`` (a float32 scalar tensor)."""


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
    shard = c.dims.fsdp_shards if c.fsdp else 1
    priced: dict[tuple[int, int], StateBytes] = {}  # ranks that differ only in dp_replicate / tp hold alike
    out = []
    for k in coords(c.dims):
        key = (k.pp, k.dp_shard if shard > 1 else 0)
        if key not in priced:
            specs = rank_params(c.size, c.dims, c.virtual, k.pp, c.v_shape)
            numel = sum(held_numel(p, c.dims, c.fsdp, k) for p in specs)
            priced[key] = StateBytes(params=4 * numel, grads=4 * numel,
                                     optimizer=ADAM_STATE_BYTES * numel + ADAM_STEP_BYTES * len(specs))
        out.append(priced[key])
    return out


def local_params(c: CellShape) -> int:
    """The most parameters any rank holds (elements)."""
    return max(s.params for s in state_bytes_by_rank(c)) // 4


def inflight_microbatches(c: CellShape, pp_rank: int = 0) -> int:
    """Microbatches whose activations a pipeline rank holds at once: all for GPipe; for 1F1B,
    ``pp - pp_rank`` (the first stage holds ``pp``, the last one), and ``pp`` when interleaved."""
    if not c.dims.pp_enabled:
        return 1
    if c.pp_schedule == "gpipe":
        return c.microbatches
    if c.virtual > 1:
        return min(c.microbatches, c.dims.pp)
    return min(c.microbatches, c.dims.pp - pp_rank)


def composite_rms_norm(c: CellShape) -> bool:
    """Whether ``nn.RMSNorm`` runs as composite ops, which also save the normalised input: on CPU always
    (torch 2.13 fuses it on CUDA only), on CUDA when the input's dtype differs from the fp32 weight's
    (autocast without FSDP's low-precision ``param_dtype``)."""
    return c.device_kind != "cuda" or (c.compute_bytes != 4 and not c.fsdp)


def _attention_token_elements(c: CellShape) -> float:
    """q, k, v (grouped-query: ``kv_dim`` wide) and the attention output, per token, on one tp rank; under
    context parallel k and v are the whole sequence's, gathered: ``cp`` times the local tokens'."""
    return (2 * c.size.q_dim + 2 * c.size.kv_dim * c.dims.cp) / c.dims.tp


def _block_token_bytes(c: CellShape) -> float:
    """Bytes one block saves per token for its backward (under ``attn``, what it keeps; every other policy
    recomputes a block to this in its backward)."""
    size, tp, lo, hi = c.size, c.dims.tp, c.compute_bytes, c.residual_bytes
    d, f = size.d_model, size.d_ff
    sp = tp if c.dims.sequence_parallel else 1
    # per token: each norm's input and output (hi), or, for a composite RMSNorm, its input and normalised
    # input upcast to fp32 (torch's composite computes in fp32 and saves both) and its output (hi);
    # q/k/v/attention output (lo, / tp); the MLP's: GELU's input and output (2 f), or SwiGLU's gate,
    # silu(gate), up and their product (4 f) (lo, / tp). Under SP the norms save their sequence-sharded
    # inputs, but the column-parallel linears save the all-gathered (full-sequence) norm outputs they
    # consume: DTensor does not re-gather in backward as Megatron does.
    norm_saved = 2 * d * 4 if size.llama and composite_rms_norm(c) else d * hi
    ln = 2 * norm_saved / sp + 2 * d * hi
    mlp = 2 * size.mlp_matrices - 2  # 2 (GELU) or 4 (SwiGLU) tensors of width d_ff
    per_layer = ln + (_attention_token_elements(c) + mlp * f / tp) * lo
    if size.moe is not None:  # k expert slots per token instead of one MLP
        per_layer += moe_token_bytes(c) - mlp * f / tp * lo
    gqa_copy = size.kv_dim != size.q_dim and c.device_kind == "cpu" and not c.fake_compute
    if gqa_copy:
        # grouped-query attention on CPU: SDPA's output is laid out (B, H, T, hd), so the output projection's
        # input is a copy (saved beside SDPA's own output; measured with saved-tensor hooks on a llama3 block).
        # A GPU's fused kernel, and fit's fake compute which stands for it, lay it out (B, T, H, hd): no copy
        per_layer += size.q_dim / tp * lo
    if size.qk_norm:  # q and k normalised per head: saved as the layer norms are
        per_layer += (size.q_dim + size.kv_dim) / tp * (2 * 4 if composite_rms_norm(c) else lo)
    if c.recompute == "attn":  # q, k, v and SDPA's output recomputed; the output projection keeps its input
        per_layer -= (_attention_token_elements(c) - (0 if gqa_copy else size.q_dim / tp)) * lo
    return per_layer


def op_token_bytes(c: CellShape) -> float:
    """What the ``op`` policy keeps of a block per token (:class:`harness.parallel.activation_checkpoint.EveryOtherMatmul`):
    the block's input (the checkpoint's; sequence-sharded under SP), the 1st, 3rd, ... matmul's output, the
    attention's output and its fp32 log-sum-exp (a head per token), and under sequence parallel the reduce-scatters'
    outputs (the attention's, and a dense MLP's; an MoE's output is sliced, not reduce-scattered). Checked
    against a real block's live tensors (tests/unit/test_ac_policies.py)."""
    size, tp, lo = c.size, c.dims.tp, c.compute_bytes
    sp = tp if c.dims.sequence_parallel else 1
    matmuls = block_matmuls(size, c.dims.ep)
    kept = sum(m.output_bytes(tp, lo) for m, keep in zip(matmuls, kept_by_op(matmuls)) if keep)
    attention = size.q_dim / tp * lo + size.n_heads / tp * 4
    scattered = (1 if size.moe else 2) * size.d_model / tp * lo if c.dims.sequence_parallel else 0
    return size.d_model * c.residual_bytes / sp + kept + attention + scattered


def kept_token_bytes(c: CellShape, layer: int) -> float:
    """Bytes block ``layer`` keeps per token for its backward under the cell's policy: its input only when it is
    checkpointed whole (``full``, ``layerN``), :func:`op_token_bytes` under ``op``, else
    :func:`_block_token_bytes`."""
    sp = c.dims.tp if c.dims.sequence_parallel else 1
    if checkpointed_layer(c.recompute, layer):
        return c.size.d_model * c.residual_bytes / sp
    if c.recompute == "op":
        return op_token_bytes(c)
    return _block_token_bytes(c)


def moe_token_bytes(c: CellShape) -> float:
    """What an MoE layer saves per token: the router's fp32 logits and scores (E each); per each of the k
    slots, three rows of d: the token's grouped copy (the experts' input), its expert's output (which the
    routing weight multiplies) and the weighted output (``index_add`` keeps its source), and the
    expert's SwiGLU tensors (4 f); the shared expert's SwiGLU tensors (4 x n_shared f)."""
    m, d = c.size.moe, c.size.d_model
    assert m is not None, f"moe_token_bytes: {c.size.key} has no MoE layer"
    return 8 * m.n_experts + (m.top_k * (3 * d + 4 * m.d_ff) + 4 * m.n_shared * m.d_ff) * c.compute_bytes


def rope_table_bytes(c: CellShape, layer: int) -> int:
    """RoPE's cos and sin (fp32, ``seq x head_dim / 2`` each), computed and saved by a llama3 block's attention
    that keeps it (no policy that recomputes the attention), once per microbatch: not per row."""
    kept = c.recompute not in ("attn", "op") and not checkpointed_layer(c.recompute, layer)
    return 4 * c.local_seq * c.size.head_dim if c.size.llama and kept else 0


def _stage_keep_bytes(c: CellShape, layers: list[int], last_stage: bool) -> int:
    """What one microbatch saves for its backward on a stage of ``layers``: what each layer keeps under the policy
    (:func:`kept_token_bytes`), the stage's output (but on the last stage, whose output is the loss), and RoPE's
    tables."""
    sp = c.dims.tp if c.dims.sequence_parallel else 1
    stage_output = 0 if last_stage else c.size.d_model * c.residual_bytes / sp
    kept = sum(kept_token_bytes(c, i) for i in layers)
    tables = sum(rope_table_bytes(c, i) for i in layers)
    return int(c.microbatch_rows * c.local_seq * (kept + stage_output)) + tables


def activation_bytes(c: CellShape, pp_rank: int = 0) -> int:
    """Activations saved for backward at their most on pipeline rank ``pp_rank`` (the first holds the most): one
    microbatch's without a pipeline; in a pipeline, each stage's (:func:`_stage_keep_bytes`) for every microbatch
    the schedule's own action order holds in flight at once (:func:`harness.model.pipeline_sim.live_peak`: GPipe all,
    1F1B ``pp - pp_rank``, a zero-bubble schedule each microbatch until its weight-gradient step)."""
    if not c.dims.pp_enabled:
        return _stage_keep_bytes(c, list(range(c.size.n_layers)), last_stage=True)
    n_stages = c.dims.pp * c.virtual
    layers = layer_ranges(c.size.n_layers, n_stages)
    keeps = {s: _stage_keep_bytes(c, list(layers[s]), last_stage=s == n_stages - 1)
             for s in stages_of_rank(pp_rank, c.dims.pp, c.virtual, c.v_shape)}
    held = {s: _weight_grad_inputs(c, list(layers[s]), last_stage=s == n_stages - 1) for s in keeps}
    order = schedule_order(c.pp_schedule, c.dims.pp, c.microbatches)[pp_rank]
    return int(live_peak(order, keeps, held))


def _weight_grad_inputs(c: CellShape, layers: list[int], last_stage: bool) -> int:
    """What a split backward's input-gradient step (I) holds for the weight-gradient step (W), one microbatch:
    the gradient at each linear's output (the intermediates torch's ``stage_backward_input`` keeps), and on the
    last stage the head's (the logits' gradient, fp32)."""
    widths = sum(m.n * m.rows for m in block_matmuls(c.size, c.dims.ep)) / c.dims.tp
    tokens = c.microbatch_rows * c.local_seq
    head = tokens * c.size.vocab_size * 4 / c.dims.tp if last_stage else 0
    return int(tokens * widths * c.compute_bytes * len(layers) + head)


def _mlp_grad_bytes(c: CellShape) -> int:
    """The MLP gradients one block's backward allocates, one microbatch: GELU's (``d_ff / tp`` per
    token), or SwiGLU's two at once (the gradients of silu(gate) and of up: ``2 d_ff / tp``)."""
    width = (c.size.mlp_matrices - 1) * c.size.d_ff
    return int(c.microbatch_rows * c.local_seq * width * c.compute_bytes / c.dims.tp)


def block_backward_bytes(c: CellShape) -> int:
    """Activations live in one block's backward, one microbatch: the block's (saved, or recomputed
    under every policy but ``attn``) and its MLP gradients."""
    return int(c.microbatch_rows * c.local_seq * _block_token_bytes(c)) + _mlp_grad_bytes(c)


def grads_live_in_forward(c: CellShape) -> bool:
    """Whether gradients exist while activations are saved: the step frees them (``zero_grad(set_to_none)``)
    before its forward, so only a later pipeline microbatch or accumulation micro-step sees them."""
    return c.dims.pp_enabled or c.grad_accum > 1


def logits_bytes(c: CellShape) -> int:
    """Logits (compute dtype), their fp32 copy for the loss and its gradient, on the last stage.

    Under tensor parallel the head is column-parallel with replicated logits
    (:mod:`harness.parallel.tp`): every rank holds its vocabulary shard and the gathered whole; under loss
    parallel only the shards (a vocabulary-parallel cross-entropy: ``V / tp`` of each, measured on a 2-rank
    head: 5.75 bytes per token and vocabulary entry in fp32 against the 6 counted). In a
    pipeline the last stage's output is the logits, and the schedule keeps every stage's output for its
    backward: one more compute-dtype copy lives until the logits' gradient is taken (measured by
    ``harness fit``: four logits-sized tensors at the last stage's peak in fp32, three without pp).
    """
    rows = c.microbatch_rows
    v = c.size.vocab_size
    kept = c.compute_bytes if c.dims.pp_enabled else 0
    if c.dims.loss_parallel:  # every one of them a vocabulary shard (V / tp); no whole copy
        return int(rows * c.local_seq * v * (c.compute_bytes + 2 * 4 + kept) / c.dims.tp)
    shard = c.compute_bytes / c.dims.tp if c.dims.tp > 1 else 0
    return int(rows * c.local_seq * v * (c.compute_bytes + 2 * 4 + shard + kept))


def _gathered_groups(c: CellShape, pp_rank: int) -> tuple[int, list[int]]:
    """Bytes of a pipeline rank's FSDP groups when gathered (parameter dtype): the root's, and each
    block's, largest first."""
    per_block: dict[int, int] = {}
    root = 0
    for p in rank_params(c.size, c.dims, c.virtual, pp_rank, c.v_shape):
        n = fsdp_padded_numel(held_shape(p, c.dims), fsdp_ways(p, c.dims)) * c.param_bytes
        if p.layer is None:
            root += n
        else:
            per_block[p.layer] = per_block.get(p.layer, 0) + n
    return root, sorted(per_block.values(), reverse=True)


def transient_param_bytes(c: CellShape, pp_rank: int = 0) -> int:
    """Buffers beside the model states at the peak: DDP gradient buckets, FSDP gathered groups."""
    if c.data_parallel == "ddp":  # wrapped in DDP even at one replica
        return 4 * local_params(c)  # DDP's bucket copies of the gradients (gradient_as_bucket_view off)
    if not c.fsdp:
        return 0
    root, blocks = _gathered_groups(c, pp_rank)
    if c.reshard_after_forward:
        return root + sum(blocks[:2])  # current block and the prefetched next one
    return root + sum(blocks)


def pipeline_unsharded_grad_bytes(c: CellShape, pp_rank: int) -> int:
    """Under FSDP in a pipeline, the stage's gradients unsharded, accumulated in fp32 over the microbatches.

    torch's pipeline schedules run every microbatch's backward with FSDP's gradient sync and its reshard
    after backward turned off, and reduce once after the last (``PipelineStage.backward_maybe_with_nosync``,
    ``perform_reduce_grad``): from a rank's first backward to the step's end it holds its stage's
    gradients and parameters unsharded, the memory ZeRO-3 saves given back for the step.
    """
    return 4 * sum(math.prod(held_shape(p, c.dims)) for p in rank_params(c.size, c.dims, c.virtual, pp_rank, c.v_shape))


def pipeline_recv_bytes(c: CellShape, pp_rank: int) -> int:
    """The receive buffers a pipeline rank's stages hold for the whole step, one per microbatch each: a stage
    that is not the first receives its input (``microbatch rows x local seq x d_model / sp`` in the residual
    stream's dtype), one that is not the last the gradient of its output, the same shape.

    torch's ``PipelineStage`` allocates them once for every microbatch when the schedule first runs
    (``_setup_forward_recv_info`` and ``_create_grad_recv_info`` in ``torch.distributed.pipelining.stage``), and
    a V's same-rank hand-over keeps the handed tensor in the buffer's place (``set_local_fwd_input``).
    """
    if not c.dims.pp_enabled:
        return 0
    n_stages = c.dims.pp * c.virtual
    sp = c.dims.tp if c.dims.sequence_parallel else 1
    hidden = c.microbatch_rows * c.local_seq * c.size.d_model * c.residual_bytes // sp
    ends = sum((s > 0) + (s < n_stages - 1) for s in stages_of_rank(pp_rank, c.dims.pp, c.virtual, c.v_shape))
    return c.microbatches * ends * hidden


def _top_block_adds(c: CellShape, pp_rank: int) -> int:
    """What the rank's last block's backward (the first it runs) adds to the saved activations: the whole block
    recomputed when it is checkpointed whole, what ``op`` did not keep of it, and its MLP gradients."""
    top = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, pp_rank, c.v_shape)[-1]
    if checkpointed_layer(c.recompute, top):
        return block_backward_bytes(c)
    if c.recompute == "op":
        rows = c.microbatch_rows * c.local_seq
        return int(rows * (_block_token_bytes(c) - op_token_bytes(c))) + _mlp_grad_bytes(c)
    return _mlp_grad_bytes(c)


def stage_peak_bytes(c: CellShape, pp_rank: int, base_bytes: float = 0.0) -> float:
    """Predicted peak of a rank on pipeline rank ``pp_rank``: parameters and optimizer state + transient
    buffers + the largest moment of the step + base. The moments:

    * the turn from forward to backward: every saved activation and the logits (last stage);
    * the top block's backward: every saved activation and what that block's backward adds;
    * the bottom block's backward, the step's last: every gradient and one block's activations.
      It is the peak under ``ac full`` when the gradients outweigh the block inputs.

    Gradients count in the first two only when they outlive a step's forward (:func:`grads_live_in_forward`).
    Under FSDP in a pipeline the gradients and gathered parameters are the stage's, unsharded
    (:func:`pipeline_unsharded_grad_bytes`): once a microbatch's backward ran, and so at the turns only when
    the rank runs more microbatches than it holds in flight; the bottom block's backward then keeps the
    other in-flight microbatches' activations, and a fourth moment, the reduce after the last microbatch,
    holds the sharded gradients beside the unsharded.
    """
    states = max((s for s, k in zip(state_bytes_by_rank(c), coords(c.dims)) if k.pp == pp_rank),
                 key=lambda s: s.total)
    block = block_backward_bytes(c)
    top_adds = _top_block_adds(c, pp_rank)
    transient = transient_param_bytes(c, pp_rank)
    saved = activation_bytes(c, pp_rank)
    logits = logits_bytes(c) if pp_rank == c.dims.pp - 1 else 0
    recv = pipeline_recv_bytes(c, pp_rank)
    if c.fsdp and c.dims.pp_enabled:
        unsharded = pipeline_unsharded_grad_bytes(c, pp_rank)
        root, blocks = _gathered_groups(c, pp_rank)
        inflight = inflight_microbatches(c, pp_rank)
        at_turn = unsharded if c.microbatches > inflight else 0
        moments: tuple[float, ...] = (saved + logits + at_turn + transient, saved + top_adds + at_turn + transient,
                                      saved * (inflight - 1) // inflight + block + unsharded + root + sum(blocks),
                                      states.grads + unsharded + root + sum(blocks))
        return states.params + states.optimizer + recv + max(moments) + base_bytes
    live_grads = states.grads if grads_live_in_forward(c) else 0
    moments = (saved + logits + live_grads, saved + top_adds + live_grads, states.grads + block)
    return states.params + states.optimizer + recv + transient + max(moments) + base_bytes


def peak_bytes(c: CellShape, base_bytes: float) -> float:
    """Predicted peak per rank: the largest over pipeline ranks (:func:`stage_peak_bytes`)."""
    return max(stage_peak_bytes(c, pp_rank, base_bytes) for pp_rank in range(c.dims.pp))
