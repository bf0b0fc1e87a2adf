"""Every collective one rank issues in a training step, with its bytes in nccl-tests sizes.

The bytes are those :class:`harness.measure.comm_counter.CommCounter` counts (all-gather: the gathered
output; reduce-scatter: the unsharded input; all-reduce, send, recv: the tensor), derived from
what each strategy's code does, so the prediction can be held to equality in a test:

* **DDP** (Li et al. 2020, PyTorch DDP): one all-reduce of every fp32 gradient per optimizer
  step (accumulation micro-steps run under ``no_sync``), in buckets of 1 MiB first, then 25 MiB
  (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, DDP ``bucket_cap_mb``), in reverse
  registration order.
* **FSDP2 / ZeRO** (Rajbhandari et al. 2020; Zhao et al. 2023): per group, an all-gather of
  the padded parameters in the parameter dtype (bf16/fp16 under ``MixedPrecisionPolicy``)
  before forward, again before backward when parameters were resharded after forward
  (ZeRO-3-like; never for the root group), one reduce-scatter of the fp32 gradients on the
  last micro-step; HSDP adds an all-reduce of the gradient shard over the replicas.
  Under pipelining the stage keeps parameters gathered from one backward to the next forward
  (``set_reshard_after_backward(False)`` in ``torch.distributed.pipelining``), so the count
  follows the schedule's order of forwards and backwards (:func:`stage_actions`).
* **Tensor parallel** (Megatron-LM, Shoeybi et al. 2019): per block, forward all-reduces the
  two row-parallel outputs (compute dtype), backward all-reduces the input gradients of the
  four column-parallel linears q, k, v, fc (each its own DTensor input, fp32 like the
  LayerNorm output they come from, low precision under FSDP mixed precision, which casts
  each group's inputs); the LM head all-gathers the logits (compute dtype) and
  all-reduces its input gradient; under loss parallel (with sequence parallel) the logits stay sharded. With **sequence parallel** (Korthikanti et al. 2022) each
  all-reduce becomes an all-gather / reduce-scatter pair around the sequence-sharded region, and the
  norms' weights, which saw one sequence shard each, have their gradients summed over tp once per step:
  in one call (:func:`harness.parallel.tp.reduce_partial_grads`), or under FSDP one call per tensor in the
  parameter dtype (FSDP2 redistributes each ``Partial`` gradient to its parameter's placement before
  reducing it).
  An MoE block (``fsdp+tp+ep``) has q, k, v and the shared expert's gate and up column-parallel,
  and the routed experts' width split: forward sums their partial outputs over the ``N k`` routed
  rows a rank received, backward the rows' input gradients (:mod:`harness.parallel.ep`).
* **Pipeline** (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021): per microbatch and
  stage boundary, the activation (residual-stream dtype) forward and its gradient backward, by send/recv.
* **Context parallel** (:mod:`harness.parallel.cp`): per layer and micro-step, one all-gather of the
  rank's k and v together (output: ``2 x rows x seq x kv_dim / tp`` in the compute dtype), again when
  the attention is recomputed (``ac`` selective or full), and one reduce-scatter of their gradients
  (input the same size); FSDP then shards over ``dp_shard x cp``.
* **Expert parallel** (:mod:`harness.parallel.ep`): per MoE layer and micro-step, forward exchanges
  the per-expert counts (``E`` int64s), sends the ``N k`` routed rows out and receives as many
  back after the experts (``d`` wide, in the residual stream's dtype); backward the same two the
  other way; full AC recomputes the forward's three. The rows a rank receives depend on the routing:
  :func:`ep_bytes` counts them for a given routing, the prediction assumes every rank receives as
  many as it sends (exact under balanced routing). The experts' FSDP group is sharded over
  ``efsdp``, and its collectives run over it alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from harness.model.block_ops import fp8_linears
from harness.model.inventory import (
    ParamSpec,
    RankCoord,
    coords,
    fsdp_padded_numel,
    fsdp_ways,
    group_of,
    held_numel,
    held_shape,
    n_stages,
    rank_layer_ids,
    rank_params,
    stage_of,
    stages_of_rank,
    tp_local_shape,
)
from harness.model.schedule import gathers, stage_actions
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import reruns_forward
from harness.parallel.tp_plan import HEAD_SHARED
from harness.units import MIB

DDP_FIRST_BUCKET_BYTES = MIB
DDP_BUCKET_BYTES = 25 * MIB
FP32 = 4


@dataclass(frozen=True)
class Call:
    """One collective call on one rank."""

    collective: str
    nbytes: int
    group: int
    """Ranks taking part (the size the bus-bandwidth factor and calibration are looked up for)."""
    dim: str
    """Mesh dimension it runs over: ``dp``, ``tp``, ``pp``, ``cp``, ``ep`` (the all-to-alls of expert parallel),
    ``efsdp`` (FSDP of the experts under expert parallel) or ``world`` (every rank: the MoE load)."""
    overlappable: bool
    """Whether the strategy can hide it behind compute (DDP buckets, FSDP prefetch, async p2p)."""


def _ddp_buckets(specs: list[ParamSpec], tp: int) -> list[int]:
    """Gradient bucket sizes in bytes: reverse registration order, 1 MiB first, then 25 MiB."""
    buckets, cur, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for p in reversed(specs):
        cur += _numel(tp_local_shape(p, tp)) * FP32
        if cur >= cap:
            buckets.append(cur)
            cur, cap = 0, DDP_BUCKET_BYTES
    if cur:
        buckets.append(cur)
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _fsdp_calls(c: CellShape, specs: list[ParamSpec], coord: RankCoord) -> list[Call]:
    dims = c.dims
    stages = n_stages(dims, c.virtual)
    groups: dict[tuple[int, str], list[ParamSpec]] = defaultdict(list)
    for p in specs:
        groups[(stage_of(p, stages, c.size.n_layers), group_of(p, dims))].append(p)
    if dims.pp_enabled:
        actions = stage_actions(c.pp_schedule, dims.pp, c.virtual, c.microbatches, coord.pp)
    else:
        actions = {0: ["F", "B"] * c.grad_accum}
    # FSDP's float8 all-gather: the float8 linears' weights travel at 1 byte an element (FSDP2 gathers a group of
    # mixed dtypes as bytes), their biases and the rest at param_dtype's
    float8 = {f"{n}.weight" for n in fp8_linears(c.size)} if c.fp8_all_gather else set()
    calls = []
    for (stage, name), members in groups.items():
        shard = fsdp_ways(members[0], dims)
        if shard == 1:  # a 1-rank FSDP mesh (efsdp 1, or fsdp at one rank): FSDP2 skips the collectives
            continue
        padded = sum(fsdp_padded_numel(held_shape(p, dims), shard) for p in members)
        gathered = sum(fsdp_padded_numel(held_shape(p, dims), shard) * (1 if p.name in float8 else c.param_bytes)
                       for p in members)
        reshard = c.reshard_after_forward and name != "root"
        if dims.pp_enabled:
            n_gather = gathers(actions[stage], reshard)
        else:  # each micro-step gathers for forward, again for backward if resharded; reshards after backward
            n_gather = c.grad_accum * (2 if reshard else 1)
        dim = "efsdp" if name.endswith(".experts") else "dp"
        calls += [Call("all_gather", gathered, shard, dim, True)] * n_gather
        calls.append(Call("reduce_scatter", padded * FP32, shard, dim, True))
        if dims.dp_replicate > 1:
            calls.append(Call("all_reduce", padded // shard * FP32, dims.dp_replicate, "dp", True))
    return calls


def _tp_calls(c: CellShape, coord: RankCoord, passes: int, rows: int) -> list[Call]:
    """Tensor-parallel collectives for ``passes`` forward+backward passes of ``rows`` sequences each."""
    size, tp, sp = c.size, c.dims.tp, c.dims.sequence_parallel
    act = rows * c.local_seq * size.d_model
    hi, lo = act * c.residual_bytes, act * c.compute_bytes
    logits = rows * c.local_seq * size.vocab_size * c.compute_bytes
    stages = n_stages(c.dims, c.virtual)
    mine = stages_of_rank(coord.pp, c.dims.pp, c.virtual, c.v_shape)
    layer_ids = rank_layer_ids(size.n_layers, c.dims.pp, c.virtual, coord.pp, c.v_shape)
    layers = len(layer_ids)
    first, last = 0 in mine, stages - 1 in mine
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"
    per_pass = []
    for i in layer_ids:  # an MoE model's dense first blocks issue a dense block's collectives
        every, again = _tp_block_calls(c.at_layer(i), hi, lo, rows * c.local_seq)
        if size.qk_norm == "proj":  # each q/k norm's squares summed over tp (fp32), again in backward
            every, again = every + [(ar, rows * c.local_seq * FP32)] * 4, again + [(ar, rows * c.local_seq * FP32)] * 2
        if c.recompute == "op":  # the op policy keeps the reduce-scatters' outputs: its rerun does not redo them
            again = [call for call in again if call[0] != rs]
        per_pass += every + (again if reruns_forward(c.recompute, i) else [])
    if sp:
        if last:  # the head's input gathered (its gradient reduce-scattered); its logits gathered but under loss
            # parallel, whose cross-entropy's own all-reduces (max, sum and target per token) run inside
            # DTensor's dispatch, where the counter does not see them
            per_pass += [(ag, hi), (rs, hi)] + ([] if c.dims.loss_parallel else [(ag, logits)])
        if first:
            per_pass += [(ag, hi)]
    elif last:
        per_pass += [(ag, logits), (ar, hi)]
    calls = [Call(k, b, tp, "tp", False) for k, b in per_pass] * passes
    if sp:  # the norms' partial gradients, summed once per step
        norms = 2 * layers + (1 if last else 0)  # weight (and LayerNorm's bias) of each
        if c.fsdp:  # FSDP2 redistributes each to its replicated placement before its reduce-scatter, one by one,
            # in the unsharded gradient's dtype: MixedPrecisionPolicy's param_dtype
            tensors = norms * size.final_norm_params // size.d_model
            calls += [Call(ar, size.d_model * c.param_bytes, tp, "tp", False)] * tensors
        else:  # in one call (harness.parallel.tp.reduce_partial_grads)
            calls.append(Call(ar, norms * size.final_norm_params * FP32, tp, "tp", False))
    if size.qk_norm == "head":  # the per-head q/k norms' gradients, summed over tp in one call before the optimizer
        shared = [p for p in rank_params(size, c.dims, c.virtual, coord.pp, c.v_shape) if p.name.endswith(HEAD_SHARED)]
        calls.append(Call(ar, sum(held_numel(p, c.dims, c.fsdp, coord) for p in shared) * FP32, tp, "tp", False))
    return calls


def _tp_block_calls(c: CellShape, hi: int, lo: int, tokens: int) -> tuple[list[tuple[str, int]],
                                                                          list[tuple[str, int]]]:
    """One block's tensor-parallel collectives, as (collective, bytes), ``tokens`` per pass: those of every
    forward+backward, and those a rerun of its forward in backward adds (activation checkpointing runs the forward's
    collectives again up to the last tensor the backward needs, where torch's checkpoint stops: the MLP's output
    collective is not redone)."""
    size = c.size
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"
    sp = c.dims.sequence_parallel
    attn_back = _attention_input_grads(c, hi, lo, tokens)
    if size.moe is not None:
        shared = 1 if size.moe.n_shared else 0
        k = size.moe.top_k
    if sp and size.moe is not None:  # the MoE routes the gathered sequence, sums over tp
        every = ([(ag, hi), (rs, lo), (ag, lo)] + attn_back + [(ag, hi), (ar, k * lo)] + [(ar, lo)] * shared +
                 [(ag, lo), (ar, k * hi)] + [(ar, hi)] * (2 * shared))
        return every, [(ag, hi), (rs, lo), (ag, hi), (ar, k * lo)] + [(ar, lo)] * shared
    if sp:  # all-gather before, reduce-scatter after each sub-layer, and back
        return [(ag, hi), (rs, lo), (ag, lo)] + attn_back + [(ag, hi), (rs, lo), (ag, lo), (rs, hi)], \
            [(ag, hi), (rs, lo), (ag, hi)]
    if size.moe is not None:  # fsdp+tp+ep (harness.parallel.ep): the experts' partial outputs summed over tp
        every = [(ar, lo)] * (1 + shared) + [(ar, k * lo)] + attn_back + [(ar, hi)] * (2 * shared) + [(ar, k * hi)]
        return every, [(ar, lo), (ar, k * lo)]
    # forward: the row-parallel outputs; backward: each column-parallel linear's input gradient
    return [(ar, lo)] * 2 + attn_back + [(ar, hi)] * (size.mlp_matrices - 1), [(ar, lo)]


def _attention_input_grads(c: CellShape, hi: int, lo: int, tokens: int) -> list[tuple[str, int]]:
    """How the gradient at the attention's input is summed over tp in backward: q, k and v's input gradients
    all-reduced one by one (or, under sequence parallel, reduce-scattered once back to the sequence shards); under
    MLA, whose low-rank path every rank runs whole on a plain tensor, the up-projections' input gradients (q_b's or
    q's, kv_b's) and the shared rotary key's, all-reduced, sequence parallel or not."""
    m, ar = c.size.mla, "all_reduce"
    if m is None:
        return [("reduce_scatter", hi)] if c.dims.sequence_parallel else [(ar, hi)] * 3
    q = (ar, tokens * m.q_rank * c.compute_bytes) if m.q_rank else (ar, hi)
    return [q, (ar, tokens * m.kv_rank * c.compute_bytes), (ar, tokens * m.rope_dim * c.compute_bytes)]


def _pp_calls(c: CellShape, coord: RankCoord) -> list[Call]:
    size, dims = c.size, c.dims
    stages = n_stages(dims, c.virtual)
    act = c.microbatch_rows * c.local_seq * size.d_model * c.residual_bytes
    if dims.sequence_parallel:
        act //= dims.tp
    calls = []
    mine = stages_of_rank(coord.pp, dims.pp, c.virtual, c.v_shape)
    for s in mine:  # a neighbour stage on this rank (the V's turn: stages pp - 1 and pp) is handed over, not sent
        n = c.microbatches
        if s > 0 and s - 1 not in mine:  # activation in, its gradient back
            calls += [Call("recv", act, 2, "pp", False)] * n + [Call("send", act, 2, "pp", True)] * n
        if s < stages - 1 and s + 1 not in mine:
            calls += [Call("send", act, 2, "pp", True)] * n + [Call("recv", act, 2, "pp", False)] * n
    return calls


def kv_gather_bytes(c: CellShape, rows: int) -> int:
    """Bytes of one layer's K/V all-gather output (and of its gradients' reduce-scatter input): the whole
    sequence's k and v for ``rows`` sequences, on one tp rank, in the compute dtype (MLA: v narrower than k)."""
    width = c.size.kv_dim + c.size.kv_heads * c.size.v_head_dim
    return rows * c.size.seq_len * width // c.dims.tp * c.compute_bytes


def _cp_calls(c: CellShape, passes: int, rows: int) -> list[Call]:
    """Context parallel's collectives for ``passes`` forward+backward passes of ``rows`` sequences each."""
    nbytes = kv_gather_bytes(c, rows)
    calls = []
    for i in range(c.size.n_layers):
        again = c.recompute == "attn" or reruns_forward(c.recompute, i)  # the recomputed attention gathers again
        calls += [Call("all_gather", nbytes, c.dims.cp, "cp", False)] * (2 if again else 1) + \
            [Call("reduce_scatter", nbytes, c.dims.cp, "cp", False)]
    return calls * passes


def _moe_ids(c: CellShape, coord: RankCoord) -> list[int]:
    """The MoE blocks on ``coord``'s pipeline stages (every MoE block without a pipeline)."""
    ids = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, coord.pp, c.v_shape)
    return [i for i in ids if c.size.is_moe_layer(i)]


def _passes(c: CellShape) -> tuple[int, int]:
    """(passes, rows each) of one optimizer step: a pipeline's microbatches, or the accumulation micro-steps."""
    if c.dims.pp_enabled:
        return c.microbatches, c.microbatch_rows
    return c.grad_accum, c.local_batch // c.grad_accum


def _forwards(c: CellShape, ids: list[int] | None = None) -> float:
    """Forwards per micro-step of an MoE block, on average over ``ids`` (every MoE block): 2 where the policy reruns
    it."""
    moe = ids if ids is not None else range(c.size.dense_layers, c.size.n_layers)
    return 1 + sum(reruns_forward(c.recompute, i) for i in moe) / len(moe) if len(moe) else 1.0


def _rerun_rows(c: CellShape, rows: float, rerun: float | None, ids: list[int] | None = None) -> float:
    """Rows of the layers whose forward ran again: as counted, or (older records) the layers' share."""
    return rerun if rerun is not None else rows * (_forwards(c, ids) - 1)


def ep_bytes(c: CellShape, sent_rows: int, received_rows: int, rerun_sent: float | None = None,
             rerun_received: float | None = None, coord: RankCoord | None = None) -> int:
    """All-to-all bytes of one rank's optimizer step whose MoE layers sent ``sent_rows`` and received
    ``received_rows`` routed rows in all (every layer and micro-step, the forward counted once), of which the
    layers activation checkpointing ran again sent ``rerun_sent`` and received ``rerun_received``; ``coord``: the
    rank (its pipeline stages' MoE blocks; default every block)."""
    assert c.size.moe is not None, f"ep_bytes: {c.size.key} has no MoE layer"
    ids = _moe_ids(c, coord) if coord is not None else list(range(c.size.dense_layers, c.size.n_layers))
    counts = _forwards(c, ids) * 8 * c.size.moe.n_experts * len(ids) * _passes(c)[0]
    moved = 2 * (sent_rows + received_rows) + _rerun_rows(c, sent_rows, rerun_sent, ids) + \
        _rerun_rows(c, received_rows, rerun_received, ids)
    return int(counts + moved * c.size.d_model * c.residual_bytes)


def ep_tp_bytes(c: CellShape, received_rows: int, rerun_received: float | None = None) -> int:
    """Bytes of the tp all-reduces of the experts' outputs and their rows' gradients (``fsdp+tp+ep``) of one
    rank's optimizer step whose experts received ``received_rows`` routed rows (the forward counted once),
    ``rerun_received`` of them in layers whose forward ran again."""
    if not c.dims.tp_enabled:
        return 0
    forwards = received_rows + _rerun_rows(c, received_rows, rerun_received)
    return int(c.size.d_model * (forwards * c.compute_bytes + received_rows * c.residual_bytes))


def _ep_calls(c: CellShape, coord: RankCoord) -> list[Call]:
    """Expert parallel's all-to-alls of ``coord``'s rank in one optimizer step (its stages' MoE blocks, each pass),
    each rank receiving as many rows as it sends (see the module docstring)."""
    moe = c.size.moe
    assert moe is not None, f"_ep_calls: {c.size.key} has no MoE layer"
    passes, rows = _passes(c)
    routed = rows * c.local_seq * moe.top_k
    rows_bytes = routed * c.size.d_model * c.residual_bytes
    forward = [Call("all_to_all", 8 * moe.n_experts, c.dims.ep, "ep", False)] + \
        [Call("all_to_all", rows_bytes, c.dims.ep, "ep", False)] * 2
    backward = [Call("all_to_all", rows_bytes, c.dims.ep, "ep", False)] * 2
    calls = []
    for i in _moe_ids(c, coord):
        calls += forward * (2 if reruns_forward(c.recompute, i) else 1) + backward
    return calls * passes


def rank_calls(c: CellShape, coord: RankCoord) -> list[Call]:
    """Every collective ``coord``'s rank issues in one optimizer step."""
    specs = rank_params(c.size, c.dims, c.virtual, coord.pp, c.v_shape)
    calls: list[Call] = []
    if c.fsdp:
        calls += _fsdp_calls(c, specs, coord)
    elif c.data_parallel == "ddp":  # DDP all-reduces its buckets even over one replica (a 1-rank group)
        calls += [Call("all_reduce", b, c.dims.dp_replicate, "dp", True) for b in _ddp_buckets(specs, c.dims.tp)]
    if c.dims.tp_enabled:
        if c.dims.pp_enabled:
            calls += _tp_calls(c, coord, c.microbatches, c.microbatch_rows)
        else:
            calls += _tp_calls(c, coord, c.grad_accum, c.local_batch // c.grad_accum)
    if c.dims.pp_enabled:
        calls += _pp_calls(c, coord)
    if c.dims.cp_enabled:  # refused with a pipeline (harness.parallel.presets.check_cp)
        calls += _cp_calls(c, c.grad_accum, c.local_batch // c.grad_accum)
    if c.dims.ep_enabled:
        calls += _ep_calls(c, coord)
    if c.size.moe is not None and c.dims.world_size > 1:
        # the experts' load, summed over every rank once per step (harness.parallel.expert_load): MoE layers x E fp32
        calls.append(Call("all_reduce", 4 * c.size.moe_layers * c.size.moe.n_experts, c.dims.world_size, "world",
                          False))
    return calls


def comm_for_routing(c: CellShape, ep: dict) -> list[dict]:
    """:func:`comm_by_rank` for the routing that happened: each rank's all-to-all bytes (and under tp the
    experts' all-reduce bytes) from the routed rows it sent and received in one step (a record's
    ``metrics.moe.ep``, rerun layers' rows apart where it has them), where the prediction assumed as many
    received as sent."""
    out = comm_by_rank(c)
    sent_by_rank, received_by_rank = ep["counted_step_rows_sent_by_rank"], ep["counted_step_rows_received_by_rank"]
    n = len(sent_by_rank)
    rerun_sent = ep.get("counted_step_rerun_rows_sent_by_rank") or [None] * n
    rerun_received = ep.get("counted_step_rerun_rows_received_by_rank") or [None] * n
    for coord, rank, sent, received, rs, rr in zip(coords(c.dims), out, sent_by_rank, received_by_rank, rerun_sent,
                                                   rerun_received, strict=True):
        rank["all_to_all"]["bytes_per_step"] = ep_bytes(c, sent, received, rs, rr, coord)
        if c.dims.tp_enabled:
            rank["all_reduce"]["bytes_per_step"] += ep_tp_bytes(c, received, rr) - ep_tp_bytes(c, sent)
    return out


def summarise(calls: list[Call]) -> dict[str, dict[str, float]]:
    """``{collective: {calls_per_step, bytes_per_step}}``, the shape of ``metrics.comm``."""
    out: dict[str, dict[str, float]] = {}
    for call in calls:
        e = out.setdefault(call.collective, {"calls_per_step": 0, "bytes_per_step": 0})
        e["calls_per_step"] += 1
        e["bytes_per_step"] += call.nbytes
    return dict(sorted(out.items()))


def comm_by_rank(c: CellShape) -> list[dict[str, dict[str, float]]]:
    """Predicted ``metrics.comm_by_rank``: per global rank, bytes and calls per collective."""
    return [summarise(rank_calls(c, k)) for k in coords(c.dims)]
