"""Memory per rank: model states (exact), activations and a predicted peak.

**Model states** (Rajbhandari et al. 2020, ZeRO section 3): this harness keeps fp32 master
parameters and fp32 gradients in every precision mode (AMP casts on the fly; FSDP gathers a
low-precision copy and frees it), and AdamW holds two fp32 moments plus a 4-byte ``step``
tensor per parameter tensor: ``16 bytes x (parameters this rank holds) + 4 x tensors``, where
"holds" is :mod:`harness.model.inventory`'s placement. ZeRO's mixed-precision count for a bf16
model with fp32 Adam (2 + 2 + 12) is also 16 bytes per parameter, so ZeRO-3 over ``n`` ranks
holds ``16 N / n``.

**Activations**: what a block saves for its backward, by architecture and policy, is
:mod:`harness.model.activations`; here, how many microbatches' worth a rank holds at its peak.

**Context parallel** (:mod:`harness.parallel.cp`): a rank holds ``1 / cp`` of each sequence's tokens,
so every per-token term above falls by ``cp``, but each layer's attention saves the *gathered* keys
and values of the whole sequence (SDPA keeps its inputs): per local token ``2 kv_dim cp / tp`` in place
of the local ``2 kv_dim / tp``. Those K/V buffers are what stops activations falling as ``1 / cp``.

**Autocast's weight copies** (bf16, fp16, fp8 without FSDP): every fp32 weight a linear uses is cast to the low
dtype, and the copies live as long as autocast's cache or the backward holds them (:func:`harness.model.weight_copies.autocast_copy_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.model.activations import (
    block_backward_bytes,
    block_token_bytes,
    kept_token_bytes,
    microbatch_tables,
    mlp_grad_bytes,
    op_token_bytes,
)
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
from harness.model.op_step import same_kind, trace_spec
from harness.model.pipeline_sim import live_peak, schedule_order, weight_pass_peak
from harness.model.shape import CellShape
from harness.model.split_memory import stage_split_bytes
from harness.model.weight_copies import autocast_copy_bytes, weight_copies
from harness.parallel.activation_checkpoint import checkpointed_layer
from harness.parallel.schedules import ZERO_BUBBLE_SCHEDULES, layer_ranges

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


def _stage_keep_bytes(c: CellShape, layers: list[int], last_stage: bool) -> int:
    """What one microbatch saves for its backward on a stage of ``layers``: what each layer keeps under the policy
    (:func:`kept_token_bytes`), the stage's output (but on the last stage, whose output is the loss), RoPE's
    tables, and under autocast the experts' weight copies each microbatch's forward makes anew
    (:attr:`WeightCopies.experts`)."""
    sp = c.dims.tp if c.dims.sequence_parallel else 1
    stage_output = 0 if last_stage else c.size.d_model * c.residual_bytes / sp
    kept = sum(kept_token_bytes(c, i) for i in layers)
    tables = sum(microbatch_tables(c, i) for i in layers)
    experts = sum(weight_copies(c, i).experts for i in layers)
    return int(c.microbatch_rows * c.local_seq * (kept + stage_output)) + tables + experts


def activation_bytes(c: CellShape, pp_rank: int = 0) -> int:
    """Activations saved for backward at their most on pipeline rank ``pp_rank`` (the first holds the most): one
    microbatch's without a pipeline; in a pipeline, each stage's (:func:`_stage_keep_bytes`) for every microbatch
    the schedule's own action order holds in flight at once (:func:`harness.model.pipeline_sim.live_peak`: GPipe all,
    1F1B ``pp - pp_rank``, a zero-bubble schedule each microbatch until its weight-gradient step)."""
    if not c.dims.pp_enabled:
        return _stage_keep_bytes(c, list(range(c.size.n_layers)), last_stage=True)
    order, keeps, held, _ = _rank_actions(c, pp_rank)
    return int(live_peak(order, keeps, held))


def split_weight_peak(c: CellShape, pp_rank: int) -> int:
    """The most activation bytes a rank holds while a split backward's weight step runs: the in-flight microbatches
    just before it (:func:`harness.model.pipeline_sim.weight_pass_peak`) and what that step holds on top, its
    checkpointed blocks' recomputed copies (:mod:`harness.model.split_memory`). 0 where no backward is split."""
    if not (c.dims.pp_enabled and c.pp_schedule in ZERO_BUBBLE_SCHEDULES):
        return 0
    return int(weight_pass_peak(*_rank_actions(c, pp_rank)))


def _rank_actions(c: CellShape, pp_rank: int) -> tuple[tuple, dict[int, int], dict[int, int], dict[int, int]]:
    """A pipeline rank's action order and, per stage it holds, what a forward keeps for one microbatch
    (:func:`_stage_keep_bytes`), what its I holds for its W and what its W holds above that (:func:`_split_passes`)."""
    n_stages = c.dims.pp * c.virtual
    layers = layer_ranges(c.size.n_layers, n_stages)
    split = _split_passes(c, pp_rank)
    keeps = {s: _stage_keep_bytes(c, list(layers[s]), last_stage=s == n_stages - 1) for s in split}
    order = schedule_order(c.pp_schedule, c.dims.pp, c.microbatches)[pp_rank]
    return order, keeps, {s: h for s, (h, _) in split.items()}, {s: w for s, (_, w) in split.items()}


def _split_passes(c: CellShape, pp_rank: int) -> dict[int, tuple[int, int]]:
    """Per stage of the rank, (held, weight): what a split backward's input step (I) holds for its weight step (W),
    one microbatch, and what W holds above it (:func:`harness.model.split_memory.stage_split_bytes`: torch's own
    split run at the rank's shapes), with on the last stage the head's (the logits' gradient, fp32). The first stage
    splits nothing (its input needs no gradient: one plain backward in its W); nor does a schedule without I."""
    n_stages = c.dims.pp * c.virtual
    stages = stages_of_rank(pp_rank, c.dims.pp, c.virtual, c.v_shape)
    if c.pp_schedule not in ZERO_BUBBLE_SCHEDULES:
        return dict.fromkeys(stages, (0, 0))
    layers = layer_ranges(c.size.n_layers, n_stages)
    tokens = c.microbatch_rows * c.local_seq
    out = {}
    for s in stages:
        ids = list(layers[s])
        held, weight = (0, 0) if s == 0 else stage_split_bytes(c.size, ids, {i: same_kind(c, i) for i in ids},
                                                                 trace_spec(c), c.dims.tp)
        head = int(tokens * c.size.vocab_size * 4 / c.dims.tp) if s == n_stages - 1 and s > 0 else 0
        out[s] = (held + head, weight)
    return out


def grads_live_in_forward(c: CellShape) -> bool:
    """Whether gradients exist while activations are saved: the step frees them (``zero_grad(set_to_none)``)
    before its forward, so only a later pipeline microbatch or accumulation micro-step sees them."""
    return c.dims.pp_enabled or c.grad_accum > 1


LOSS_BACKWARD_FP32 = 3
"""Logits-sized fp32 tensors at the loss's backward, in every precision: log-softmax's saved output, the gradient
``nll_loss_backward`` makes and the one ``_log_softmax_backward_data`` makes from it (TensorBytes on a llama3 mini step
under autocast bf16: three ``(tokens, V)`` float32 tensors live at ``_log_softmax_backward_data``, the bf16 logits and
their fp32 copy already freed)."""


def logits_bytes(c: CellShape) -> int:
    """The loss's backward on the last stage: :data:`LOSS_BACKWARD_FP32` fp32 logits-sized tensors, whatever the
    compute dtype (the forward's, lower under autocast, is :func:`forward_logits_bytes`).

    Under tensor parallel the head is column-parallel with replicated logits
    (:mod:`harness.parallel.tp`): every rank holds its vocabulary shard and the gathered whole; under loss
    parallel only the shards (a vocabulary-parallel cross-entropy: ``V / tp`` of each, measured on a 2-rank
    head: 5.75 bytes per token and vocabulary entry in fp32 against the 6 counted). In a
    pipeline the last stage's output is the logits, and the schedule keeps every stage's output for its
    backward: one more compute-dtype copy lives until the logits' gradient is taken (measured by
    ``harness fit``: four logits-sized tensors at the last stage's peak in fp32, three without pp).
    """
    kept = c.compute_bytes if c.dims.pp_enabled else 0
    return _per_logit(c, LOSS_BACKWARD_FP32 * 4 + kept)


def forward_logits_bytes(c: CellShape) -> int:
    """The loss's forward on the last stage: the logits in the compute dtype, under autocast their fp32 copy
    (``lm_loss``'s ``.float()``; a no-op in fp32) and log-softmax's fp32 output. Below :func:`logits_bytes` in every
    precision; it matters at the moment autocast's cache still holds every weight copy (:func:`harness.model.weight_copies.autocast_copy_bytes`).
    """
    lo = c.compute_bytes
    return _per_logit(c, lo + (4 if lo != 4 else 0) + 4)


def _per_logit(c: CellShape, nbytes: int) -> int:
    """``nbytes`` per token and vocabulary entry on the last stage, with tensor parallel's vocabulary shard (the head's
    own output, compute dtype) beside the gathered logits, or under loss parallel all of it sharded."""
    rows, v = c.microbatch_rows, c.size.vocab_size
    if c.dims.loss_parallel:  # every one of them a vocabulary shard (V / tp); no whole copy
        return int(rows * c.local_seq * v * nbytes / c.dims.tp)
    shard = c.compute_bytes / c.dims.tp if c.dims.tp > 1 else 0
    return int(rows * c.local_seq * v * (nbytes + shard))


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
    at = c.at_layer(top)
    if checkpointed_layer(c.recompute, top):
        return block_backward_bytes(at)
    if c.recompute == "op":
        rows = c.microbatch_rows * c.local_seq
        return int(rows * (block_token_bytes(at) - op_token_bytes(at))) + mlp_grad_bytes(at)
    return mlp_grad_bytes(at)


def _top_block_grad_bytes(c: CellShape, pp_rank: int, live: bool) -> int:
    """The gradients the rank's last block's backward makes. Where none exist yet (``live`` False): the block's,
    fp32, or under FSDP unsharded in the parameter dtype until their reduce-scatter. Where earlier microbatches'
    exist, each new one is made apart and added into them: the largest at once. An MoE block's stacked experts
    (unbound per expert in forward) get every expert's gradient of all three weights before they are stacked into
    their tensors: the three tensors' worth at once (within 3% of :class:`harness.measure.tensor_bytes.TensorBytes`'
    peaks of Mixtral's shrunk cells)."""
    top = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, pp_rank, c.v_shape)[-1]
    sizes = [(math.prod(held_shape(p, c.dims)), p.expert)
             for p in rank_params(c.size, c.dims, c.virtual, pp_rank, c.v_shape) if p.layer == top]
    experts = [n for n, expert in sizes if expert]
    stacking = 4 * sum(experts)
    if live:
        return max(stacking, 4 * max(n for n, _ in sizes))
    return sum(n for n, expert in sizes if not expert) * (c.param_bytes if c.fsdp else 4) + stacking


def optimizer_temp_bytes(c: CellShape, pp_rank: int) -> int:
    """What the optimizer step allocates beside the states: torch's single-tensor AdamW (a CPU rank's, unfused) makes
    three temporaries the size of each tensor in turn (measured with :class:`harness.measure.tensor_bytes.TensorBytes`:
    three of the largest); a GPU's multi-tensor and the fused kernel are not counted here."""
    if c.device_kind != "cpu" or c.optimizer != "adamw":
        return 0
    coord = next(k for k in coords(c.dims) if k.pp == pp_rank)
    largest = max(held_numel(p, c.dims, c.fsdp, coord) for p in rank_params(c.size, c.dims, c.virtual, pp_rank,
                                                                             c.v_shape))
    return 3 * 4 * largest


def stage_peak_bytes(c: CellShape, pp_rank: int, base_bytes: float = 0.0) -> float:
    """Predicted peak of a rank on pipeline rank ``pp_rank``: parameters and optimizer state + transient
    buffers + the largest moment of the step + base. The moments:

    * the forward's end: every saved activation and the loss's forward (:func:`forward_logits_bytes`, last stage);
    * the loss's backward: every saved activation and its fp32 tensors (:func:`logits_bytes`, last stage);
    * the top block's backward: every saved activation and what that block's backward adds;
    * the bottom block's backward, the step's last: every gradient and one block's activations.
      It is the peak under ``ac full`` when the gradients outweigh the block inputs;
    * the optimizer step: every gradient and the step's temporaries (:func:`optimizer_temp_bytes`);
    * a split backward's weight step (zero-bubble schedules): the microbatches in flight then and what the step holds
      on top (:func:`split_weight_peak`), beside the gradients.

    Under autocast without FSDP each of the first four also holds the weights' low-precision copies alive then
    (:func:`harness.model.weight_copies.autocast_copy_bytes`).

    Gradients count in the first three only when they outlive a step's forward (:func:`grads_live_in_forward`).
    Under FSDP in a pipeline the gradients and gathered parameters are the stage's, unsharded
    (:func:`pipeline_unsharded_grad_bytes`): once a microbatch's backward ran, and so at the turns only when
    the rank runs more microbatches than it holds in flight; the bottom block's backward then keeps the
    other in-flight microbatches' activations, and a fourth moment, the reduce after the last microbatch,
    holds the sharded gradients beside the unsharded.
    """
    states = max((s for s, k in zip(state_bytes_by_rank(c), coords(c.dims)) if k.pp == pp_rank),
                 key=lambda s: s.total)
    block = block_backward_bytes(c.at_layer(rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, pp_rank,
                                                            c.v_shape)[0]))
    top_adds = _top_block_adds(c, pp_rank)
    optimizer_step = states.grads + optimizer_temp_bytes(c, pp_rank)
    transient = transient_param_bytes(c, pp_rank)
    saved = activation_bytes(c, pp_rank)
    split_w = split_weight_peak(c, pp_rank)
    last = pp_rank == c.dims.pp - 1
    logits = logits_bytes(c) if last else 0
    recv = pipeline_recv_bytes(c, pp_rank)
    if c.fsdp and c.dims.pp_enabled:
        unsharded = pipeline_unsharded_grad_bytes(c, pp_rank)
        root, blocks = _gathered_groups(c, pp_rank)
        inflight = inflight_microbatches(c, pp_rank)
        at_turn = unsharded if c.microbatches > inflight else 0
        moments: tuple[float, ...] = (saved + logits + at_turn + transient, saved + top_adds + at_turn + transient,
                                      saved * (inflight - 1) // inflight + block + unsharded + root + sum(blocks),
                                      states.grads + unsharded + root + sum(blocks), optimizer_step,
                                      split_w + at_turn + transient)
        return states.params + states.optimizer + recv + max(moments) + base_bytes
    live_grads = states.grads if grads_live_in_forward(c) else 0
    top_grads = _top_block_grad_bytes(c, pp_rank, live=bool(live_grads) and not c.fsdp)
    forward_end, loss_backward, top_backward, bottom_backward = autocast_copy_bytes(c, pp_rank)
    moments = (saved + (forward_logits_bytes(c) if last else 0) + live_grads + forward_end,
               saved + logits + live_grads + loss_backward, saved + top_adds + top_grads + live_grads + top_backward,
               states.grads + block + bottom_backward, optimizer_step, split_w + top_grads + live_grads)
    return states.params + states.optimizer + recv + transient + max(moments) + base_bytes


def peak_bytes(c: CellShape, base_bytes: float) -> float:
    """Predicted peak per rank: the largest over pipeline ranks (:func:`stage_peak_bytes`)."""
    return max(stage_peak_bytes(c, pp_rank, base_bytes) for pp_rank in range(c.dims.pp))
