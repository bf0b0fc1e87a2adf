"""Compute time of a rank's step, from a workload calibration (or the matmul peak alone).

The workload calibration (:mod:`harness.calibration.workload`, ``harness calibrate --workloads SIZE
--concurrent K``) times, with a
rank's thread count and K copies running at once (as K ranks of a node compute at once, sharing
cores, caches and memory bandwidth; each time the slowest copy's), a forward+backward pass of the size at 1, 2, 4 and 8 sequences and one AdamW
step, and fits the pass time as ``alpha + rows * beta`` (least squares): ``alpha`` is the
per-pass cost that does not shrink with the batch (kernel launches, Python, small-kernel
inefficiency), ``beta`` the cost per sequence. It is the compute analogue of the latency /
bandwidth (Hockney) model used for collectives. A rank's share of a pass scales ``beta`` by
its share of the model FLOPs (tensor parallel: ``1 / tp``; a pipeline stage: its layers and
head) and ``alpha`` by its share of the layers. The strategy's wrappers cost time of their own
(FSDP2's hooks and parameter copy-in/out, DTensor's Python dispatch): the calibration times one
pass through the real ``apply_fsdp`` / ``apply_tp`` on a one-rank group, where collectives move
nothing, and adds the difference to ``alpha``; the optimizer step scales with the parameters
the rank holds (AdamW is memory-bound: Kingma & Ba 2015, one pass over four fp32 tensors), plus,
for DTensor parameters (FSDP2, TP), the wrapped AdamW step's extra time on that one-rank group: a
dispatch cost per parameter tensor that sharding does not shrink.

Without a workload calibration the model falls back to the roofline bound: ``alpha = 0`` and
``beta`` = FLOPs per sequence / calibrated (or datasheet) matmul peak, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from harness.model.block_ops import block_matmuls, kept_by_op
from harness.model.inventory import rank_layer_ids, stages_of_rank
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import checkpointed_layer
from workloads.sizes import ModelSize


@dataclass(frozen=True)
class ComputeRates:
    """Per-pass cost model of one device (or CPU rank) for one size, dtype and thread count."""

    alpha_s: float
    """Per forward+backward pass, independent of the rows."""
    beta_s_per_row: float
    """Per sequence of the calibrated length, whole model."""
    optimizer_s_per_param: float
    """AdamW step (and zero_grad) per parameter the rank holds."""
    basis: str
    """``workload`` (measured passes) or ``matmul peak`` (roofline bound: no workload calibration)."""
    base_gib: float | None = None
    """Process memory before the model exists (CPU: the RSS of an interpreter with torch loaded)."""
    wrapper_overhead_s: float = 0.0
    """Extra per-pass cost of the strategy's wrappers (FSDP2 hooks, DTensor dispatch), whole model."""
    wrapper_optimizer_s: float = 0.0
    """Extra AdamW step cost over the wrappers' DTensor parameters (dispatch per tensor), whole model."""
    stage_pass_s: tuple[float, ...] | None = None
    """Per pipeline rank, one microbatch's pass priced op by op (:mod:`harness.model.op_step`): its tp, cp and ep
    split and its recomputation already in it, in place of ``alpha + rows x beta`` over the rank's share."""


@dataclass(frozen=True)
class CoreSharing:
    """How a node's CPU ranks share its cores: processor sharing, relative to the calibrated rates.

    A rank's pass with ``busy`` ranks computing at once (each on ``threads`` threads over
    ``cores`` cores) takes ``max(1, busy * threads / cores)`` times its time alone; the rates
    were calibrated with ``calibrated_busy`` ranks computing at once (the workload calibration
    runs the node's ranks in lockstep; the roofline bound is one rank alone). Data and tensor
    parallel ranks all compute at once, as calibrated; pipeline stages take turns, so in the
    ramp-up and ramp-down fewer compete for the cores (:func:`pipeline_time_s`). GPUs share
    nothing: :data:`NO_SHARING`.
    """

    cores: float
    threads: int
    calibrated_busy: int
    node_ranks: int = 1
    """The ranks on the node (all busy at once outside a pipeline)."""

    def factor(self, busy: int) -> float:
        """A pass's time with ``busy`` ranks computing, over its time at the calibrated rates."""
        def load(n: int) -> float:
            return max(1.0, n * max(1, self.threads) / self.cores)

        return load(busy) / load(self.calibrated_busy)


NO_SHARING = CoreSharing(cores=float("inf"), threads=1, calibrated_busy=1)


def pipeline_time_s(stage_pass_s: float, pp: int, virtual: int, microbatches: int, ranks_per_stage: int,
                    sharing: CoreSharing) -> float:
    """The slowest stage's compute plus bubble over one step of a ``pp``-stage pipeline.

    The schedule is ``v * m + p - 1`` slots of one chunk's pass (``stage_pass_s / v``), with
    ``min(j + 1, p, v*m + p - 1 - j)`` stages busy in slot ``j`` (Narayanan et al. 2021): with no
    sharing this is ``m * s * (1 + (p - 1) / (v m))``, compute plus the textbook bubble. CPU
    stages share cores, so each slot's pass is slowed by the stages busy in it, and an
    oversubscribed node fills part of the bubble with other stages' work.
    """
    slots = virtual * microbatches + pp - 1
    busy = (min(j + 1, pp, slots - j) for j in range(slots))
    return stage_pass_s / virtual * sum(sharing.factor(b * ranks_per_stage) for b in busy)


def layer_flops_per_token(c: CellShape, layer: int | None = None) -> float:
    """Block ``layer``'s FLOPs per token (6 x the weights a token multiplies + the attention square); an MoE block's
    idle experts (E - k of them) do none. Without ``layer``: the mean block's."""
    s = c.size
    if layer is None:
        return sum(layer_flops_per_token(c, i) for i in range(s.n_layers)) / s.n_layers
    return 6 * s.layer_matmul_params(layer) + 6 * s.attention_width * s.seq_len


def head_flops_per_token(c: CellShape) -> float:
    return 6 * c.size.d_model * c.size.vocab_size


def expert_flop_share(c: CellShape) -> float:
    """The routed experts' share of the model's FLOPs per token (0 for a dense model): each token's k
    SwiGLU experts, 3 matrices of ``d x f``, forward and backward, in every MoE block."""
    moe = c.size.moe
    if moe is None:
        return 0.0
    experts = c.size.moe_layers * 6 * moe.top_k * 3 * c.size.d_model * moe.d_ff
    return experts / (c.size.n_layers * layer_flops_per_token(c) + head_flops_per_token(c))


def stage_shares(c: CellShape) -> list[tuple[float, float]]:
    """Per pipeline rank: (share of the model FLOPs, share of the layers) it computes."""
    stages = c.dims.pp * c.virtual
    flops = [layer_flops_per_token(c, i) for i in range(c.size.n_layers)]
    hf = head_flops_per_token(c)
    total = sum(flops) + hf
    out = []
    for p in range(c.dims.pp):
        mine = stages_of_rank(p, c.dims.pp, c.virtual, c.v_shape)
        layers = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, p, c.v_shape)
        head = stages - 1 in mine
        out.append(((sum(flops[i] for i in layers) + (hf if head else 0)) / total,
                    (len(layers) + (1 if head else 0)) / (c.size.n_layers + 1)))
    return out


def pass_time_s(rates: ComputeRates, rows: float, flop_share: float, layer_share: float, split: int) -> float:
    """One forward+backward pass of ``rows`` sequences over a rank's share of the model, its FLOPs split
    ``split`` ways (tp x cp: tensor parallel splits each matmul, context parallel each sequence, causal
    attention included, evenly by the head-tail layout)."""
    return (rates.alpha_s + rates.wrapper_overhead_s) * layer_share + rows * rates.beta_s_per_row * flop_share / split


WRAPPERS = ("fsdp", "tp", "tp-sp", "fsdp+tp")
"""The strategy wrappers whose own per-pass cost the workload calibration measures (``tp-sp``:
sequence parallelism adds a DTensor redistribution at every LayerNorm boundary)."""


def wrapper_of(c: CellShape) -> str | None:
    """Which calibrated wrapper overhead a cell pays: FSDP2 hooks, DTensor (tp, tp-sp) dispatch, or both."""
    fsdp, tp = c.fsdp, c.dims.tp_enabled
    if fsdp and tp:
        return "fsdp+tp"
    if tp:
        return "tp-sp" if c.dims.sequence_parallel else "tp"
    return "fsdp" if fsdp else None


def roofline_rates(c: CellShape, peak_tflops: float, mem_gbps: float | None = None) -> ComputeRates:
    """The bound with no workload calibration: matmul FLOPs at the peak, AdamW at memory bandwidth."""
    flops_per_row = c.size.flops_per_token() * c.size.seq_len
    opt = 28.0 / (mem_gbps * 1e9) if mem_gbps else 0.0  # AdamW reads param, grad, m, v; writes param, m, v (fp32)
    return ComputeRates(alpha_s=0.0, beta_s_per_row=flops_per_row / (peak_tflops * 1e12),
                        optimizer_s_per_param=opt, basis="matmul peak")


def rates_from_entry(entry: dict, wrapper: str | None = None) -> ComputeRates:
    def of(key: str) -> float:
        return (entry.get(key) or {}).get(wrapper, 0.0) if wrapper else 0.0

    return ComputeRates(alpha_s=entry["alpha_s"], beta_s_per_row=entry["beta_s_per_row"],
                        optimizer_s_per_param=entry["optimizer_s_per_param"], basis="workload",
                        base_gib=entry.get("base_gib"), wrapper_overhead_s=of("wrapper_overhead_s"),
                        wrapper_optimizer_s=of("wrapper_optimizer_s"))


def recompute_factor(c: CellShape) -> float:
    """Executed FLOPs over model FLOPs: recomputation repeats forward work (Korthikanti et al. 2022): the model's FLOPs
    per token and each block's :func:`recompute_extra`."""
    model = c.size.flops_per_token()
    return (model + sum(recompute_extra(c))) / model


def recompute_extra(c: CellShape) -> list[float]:
    """Per block, the forward FLOPs per token its recomputation runs again, once.

    A block checkpointed whole (``full``, ``layerN``'s) runs its forward again: 2 FLOPs per weight a token
    computes with (an MoE's k routed experts and the router, not all E) and the attention; ``attn`` the q, k,
    v projections and the attention; ``op`` the matmuls it did not keep (:func:`harness.model.block_ops.kept_by_op`),
    the attention kept.
    """
    size = c.size
    attention = 2 * size.attention_width * size.seq_len  # scores and values of one layer, forward
    out = []
    for i in range(size.n_layers):
        if checkpointed_layer(c.recompute, i):
            out.append(2 * size.layer_matmul_params(i) + attention - early_stopped_flops(size, i))
        elif c.recompute == "attn":
            out.append(2 * size.qkv_params + attention)
        elif c.recompute == "op":
            matmuls = block_matmuls(size.at_layer(i), c.dims.ep)
            kept = kept_by_op(matmuls)
            out.append(sum(m.flops(1) for m, keep in zip(matmuls, kept) if not keep)
                       - (early_stopped_flops(size, i) if not kept[-1] else 0.0))
        else:
            out.append(0.0)
    return out


def early_stopped_flops(size: ModelSize, layer: int) -> float:
    """Forward FLOPs per token a checkpointed block's recomputation skips: torch's checkpoint stops once the last
    tensor the backward needs is back (its early stop, on by default), and a dense block's MLP output projection
    saves only its inputs (its output goes to the residual add, which saves nothing), so it never runs again.
    Counted on gpt2, llama3 and moe tiny (``harness.measure.op_tally``, early stop on and off: a dense block
    recomputes 5 of 6 and 6 of 7 matmuls under ``full``; an MoE block all of its, its experts' outputs weighted
    by the router's, which saves them). 0 for an MoE block."""
    block = size.at_layer(layer)
    return 0.0 if block.moe is not None else block_matmuls(block)[-1].flops(1)


def with_recompute(rates: ComputeRates, c: CellShape, runs: Mapping[int, float] | None = None) -> ComputeRates:
    """``rates`` with the per-row time scaled by :func:`recompute_factor` (the fixed cost stays). With ``runs`` (how
    many times a split backward runs each block's recomputation: :func:`harness.model.op_step.block_runs`) where any
    is above 1, each pipeline rank's pass apart (``stage_pass_s``): its share of the model's FLOPs and its own blocks'
    recomputation that many times."""
    scaled = replace(rates, beta_s_per_row=rates.beta_s_per_row * recompute_factor(c))
    if runs is None or all(r == 1 for r in runs.values()):
        return scaled
    extra, model = recompute_extra(c), c.size.flops_per_token()
    executed = model + sum(extra)  # what the scaled per-row time stands for
    passes = []
    for p, (flop_share, layer_share) in enumerate(stage_shares(c)):
        mine = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, p, c.v_shape)
        flops = flop_share * model + sum(extra[i] * runs[i] for i in mine)
        passes.append(pass_time_s(scaled, c.microbatch_rows, flops / executed, layer_share, c.dims.tp * c.dims.cp))
    return replace(scaled, stage_pass_s=tuple(passes))
