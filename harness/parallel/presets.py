"""Named strategies -> parallel degrees for a device count, and the checks a cell must pass.

:func:`resolve` is the one place a strategy becomes degrees: it returns a :class:`Layout`,
which also carries what follows from them (is ``fully_shard`` applied, which dimensions
synchronise gradients). The planner, the worker, ``parallelize()`` and the model all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.errors import UsageError
from harness.parallel.dims import ParallelDims
from harness.parallel.schedules import check_pipeline, check_schedule_layout, stages_per_rank
from harness.precision import check_strategy
from workloads.own_model import OwnModel
from workloads.sizes import ModelSize

STRATEGIES = ("single", "ddp", "fsdp", "zero2", "hsdp", "tp", "tp-sp", "pp", "fsdp+tp", "pp+fsdp", "pp+fsdp+tp",
              "fsdp+cp", "fsdp+tp+cp", "fsdp+ep", "fsdp+tp+ep", "pp+fsdp+ep")
DEGREE_NAMES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
SP_NAMED = {"tp": False, "tp-sp": True}
"""Presets whose name says whether tensor parallel runs with sequence parallel. Every other layout with
tp > 1 runs it by default, as torchtitan's 2-D/3-D layouts and Megatron's TP runs always do
(``--sp off`` measures the textbook layout instead)."""


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy does beyond its degrees."""

    data_parallel: str
    """``none``, ``ddp`` (all-reduce), ``fsdp`` (fully_shard) or ``hsdp`` (replicate x shard)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3-like) or keep them to backward (ZeRO-2-like)."""

    @property
    def synced_dims(self) -> tuple[str, ...]:
        """Data-parallel mesh dimensions over which this strategy synchronises gradients."""
        return SYNCED_DIMS[self.data_parallel]


SYNCED_DIMS = {"none": (), "ddp": ("dp_replicate",), "fsdp": ("dp_shard",), "hsdp": ("dp_replicate", "dp_shard")}
"""``parallelize`` syncs over dp_replicate only for DDP, over dp_shard only for FSDP, over both for HSDP."""


OPTIONS = {
    "single": StrategyOptions("none"),
    "ddp": StrategyOptions("ddp"),
    "fsdp": StrategyOptions("fsdp", reshard_after_forward=True),
    "zero2": StrategyOptions("fsdp", reshard_after_forward=False),
    "hsdp": StrategyOptions("hsdp"),
    "tp": StrategyOptions("none"),
    "tp-sp": StrategyOptions("none"),
    "pp": StrategyOptions("none"),
    "fsdp+tp": StrategyOptions("fsdp"),
    "pp+fsdp": StrategyOptions("fsdp"),
    "pp+fsdp+tp": StrategyOptions("fsdp"),
    "fsdp+cp": StrategyOptions("fsdp"),
    "fsdp+tp+cp": StrategyOptions("fsdp"),
    "fsdp+ep": StrategyOptions("fsdp"),
    "fsdp+tp+ep": StrategyOptions("fsdp"),
    "pp+fsdp+ep": StrategyOptions("fsdp"),
}


def _need(strategy: str, world: int, minimum: int, multiple: int, shape: str) -> None:
    if world < minimum or world % multiple:
        div = f" divisible by {multiple}" if multiple > 1 else ""
        raise UsageError(f"strategy {strategy} needs a device count >= {minimum}{div} ({shape}), got --gpus {world}")


def sp_of(strategy: str, tp: int, sequence_parallel: bool = True) -> bool:
    """Whether a layout with ``tp`` runs sequence parallel: as the preset's name says (``tp``, ``tp-sp``), else
    wherever tp > 1 unless turned off."""
    if tp < 2:
        return False
    return SP_NAMED.get(strategy, sequence_parallel)


def degrees_for(strategy: str, world: int, sequence_parallel: bool = True) -> ParallelDims:
    """Map a strategy name and device count to validated degrees.

    Hybrids give the inner dimensions 2 ways and the data-parallel dimension the rest, so each
    named dimension is really exercised (a degree of 1 would silently be a different strategy).
    A hybrid with tp runs sequence parallel unless ``sequence_parallel`` is False (:func:`sp_of`).
    """
    dims = _preset_dims(strategy, world)
    sp = sp_of(strategy, dims.tp, sequence_parallel)
    return replace(dims, sequence_parallel=True) if sp else dims


def _preset_dims(strategy: str, world: int) -> ParallelDims:
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "single":
        return ParallelDims(world_size=1)
    if strategy in ("ddp", "fsdp", "zero2", "tp", "tp-sp", "pp", "fsdp+ep"):
        _need(strategy, world, 2, 1, "one dimension over all devices")
    if strategy == "ddp":
        return ParallelDims(dp_replicate=world, world_size=world)
    if strategy in ("fsdp", "zero2"):
        return ParallelDims(dp_shard=world, world_size=world)
    if strategy == "fsdp+ep":  # every shard an expert-parallel rank (efsdp 1); --degrees ep=N for fewer
        return ParallelDims(dp_shard=world, ep=world, world_size=world)
    if strategy in ("tp", "tp-sp"):
        return ParallelDims(tp=world, world_size=world)
    if strategy == "pp":
        return ParallelDims(pp=world, world_size=world)
    if strategy == "hsdp":
        _need(strategy, world, 4, 2, "2 replicas x >= 2 shards")
        return ParallelDims(dp_replicate=2, dp_shard=world // 2, world_size=world)
    if strategy == "fsdp+tp":
        _need(strategy, world, 4, 2, ">= 2 shards x tp 2")
        return ParallelDims(dp_shard=world // 2, tp=2, world_size=world)
    if strategy == "pp+fsdp":
        _need(strategy, world, 4, 2, "pp 2 x >= 2 shards")
        return ParallelDims(pp=2, dp_shard=world // 2, world_size=world)
    if strategy == "fsdp+cp":
        _need(strategy, world, 2, 2, "cp 2 x the rest sharded")
        return ParallelDims(dp_shard=world // 2, cp=2, world_size=world)
    if strategy == "fsdp+tp+ep":  # Megatron's EP x TP: ep from the shards, experts tensor-parallel too
        _need(strategy, world, 4, 2, "tp 2 x >= 2 shards, every shard an expert-parallel rank")
        return ParallelDims(dp_shard=world // 2, tp=2, ep=world // 2, world_size=world)
    if strategy == "pp+fsdp+ep":  # DeepSeek-V3's layout: stages, the experts split over each stage's shards
        _need(strategy, world, 4, 2, "pp 2 x >= 2 shards, every shard an expert-parallel rank")
        return ParallelDims(pp=2, dp_shard=world // 2, ep=world // 2, world_size=world)
    if strategy == "fsdp+tp+cp":
        _need(strategy, world, 4, 4, "cp 2 x tp 2 x the rest sharded")
        return ParallelDims(dp_shard=world // 4, cp=2, tp=2, world_size=world)
    _need(strategy, world, 8, 4, "pp 2 x >= 2 shards x tp 2")
    return ParallelDims(pp=2, dp_shard=world // 4, tp=2, world_size=world)


@dataclass(frozen=True)
class Layout:
    """A strategy resolved at a world size: its degrees and what follows from them."""

    strategy: str
    dims: ParallelDims

    @property
    def options(self) -> StrategyOptions:
        return OPTIONS[self.strategy]

    @property
    def data_parallel(self) -> str:
        return self.options.data_parallel

    @property
    def fsdp(self) -> bool:
        """Whether ``fully_shard`` is applied: FSDP-family strategies with a data-parallel or context-parallel
        degree, and the pure FSDP strategies always (on one rank it still wraps, so the cost is measured)."""
        return self.data_parallel in ("fsdp", "hsdp") and (
            self.dims.dp_enabled or self.dims.cp_enabled or self.strategy in ("fsdp", "zero2", "hsdp"))

    @property
    def reshard_after_forward(self) -> bool:
        return self.options.reshard_after_forward

    def virtual_stages(self, pp_schedule: str) -> int:
        """Pipeline stages per rank (1 without a pipeline)."""
        return stages_per_rank(pp_schedule) if self.dims.pp_enabled else 1


def resolve(strategy: str, world: int, override: dict | None = None, sequence_parallel: bool = True) -> Layout:
    """The preset's degrees, or an explicit override validated against the world size and the
    dimensions the strategy synchronises (an unsynchronised replica would silently diverge).

    Sequence parallel follows :func:`sp_of`; a record's resolved degrees carry ``sp`` (1 when on,
    :meth:`ParallelDims.degrees`), which decides it when present, so a record's config resolves as it ran.
    """
    override = dict(override or {})
    if "sp" in override:
        sequence_parallel = bool(override.pop("sp"))
    if not override:
        return Layout(strategy, degrees_for(strategy, world, sequence_parallel))
    unknown = set(override) - set(DEGREE_NAMES)
    if unknown:
        raise UsageError(f"unknown degree names {sorted(unknown)}; use {', '.join(DEGREE_NAMES)}")
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    dims = ParallelDims(**override, world_size=world,
                        sequence_parallel=sp_of(strategy, override.get("tp", 1), sequence_parallel))
    syncs = OPTIONS[strategy].synced_dims
    for name in ("dp_replicate", "dp_shard"):
        if getattr(dims, name) > 1 and name not in syncs:
            raise UsageError(f"strategy {strategy} does not synchronise gradients over {name} "
                             f"({getattr(dims, name)}): its replicas would diverge; set {name}=1 or pick a strategy "
                             f"that uses it ({'ddp/hsdp' if name == 'dp_replicate' else 'fsdp/zero2/hsdp'})")
    check_cp(strategy, dims)
    check_ep(strategy, dims)
    return Layout(strategy, dims)


PP_PRESETS = tuple(s for s in STRATEGIES if "pp" in s.split("+"))
"""Presets with a pipeline: the ones a pipeline schedule varies."""
CP_PRESETS = {"fsdp+cp": 1, "fsdp+tp+cp": 2}
"""The context-parallel presets and the tp degree each holds fixed."""
EP_PRESETS = {"fsdp+ep": (1, 1), "fsdp+tp+ep": (2, 1), "pp+fsdp+ep": (1, 2)}
"""The expert-parallel presets and the (tp, pp) degrees each holds fixed."""


def degree_variants(strategy: str, world: int, n_experts: int | None = None) -> list[dict[str, int]]:
    """Degrees of every cp that divides what a context-parallel preset leaves after tp (FSDP over the rest),
    or of every ep > 1 that divides the shards and ``n_experts`` for an expert-parallel preset, so ``plan``
    and ``fit`` rank cp (ep) 2, 4, ... of one preset against each other; [] for other strategies."""
    if strategy in EP_PRESETS:
        tp, pp = EP_PRESETS[strategy]
        if world % (tp * pp):
            return []
        shards = world // (tp * pp)
        return [{"dp_shard": shards, "ep": ep} | ({"tp": tp} if tp > 1 else {}) | ({"pp": pp} if pp > 1 else {})
                for ep in range(2, shards + 1) if shards % ep == 0 and (n_experts is None or n_experts % ep == 0)]
    cp_tp = CP_PRESETS.get(strategy)
    if cp_tp is None or world % cp_tp:
        return []
    rest = world // cp_tp
    return [{"dp_shard": rest // cp, "cp": cp, "tp": cp_tp} for cp in range(2, rest + 1) if rest % cp == 0]


def check_ep(strategy: str, dims: ParallelDims) -> None:
    """Expert parallel borrows FSDP's shards: it needs an FSDP strategy, and no cp beside it; with tp (which shards
    the experts' width too, and under sequence parallel the MoE routes the gathered sequence: :mod:`harness.parallel.ep`,
    :func:`harness.parallel.tp.apply_tp`) or with a pipeline (each stage's experts split over its shards), not both."""
    if not dims.ep_enabled:
        return
    if OPTIONS[strategy].data_parallel != "fsdp":
        raise UsageError(f"ep ({dims.ep}) needs an FSDP strategy, whose shards it borrows (dp_shard = efsdp x ep); "
                         f"strategy {strategy} does not shard: use fsdp+ep")
    if dims.cp_enabled:
        raise UsageError(f"ep ({dims.ep}) with cp ({dims.cp}) is not supported: expert parallel is built beside FSDP, "
                         f"tp and pp; set cp=1, or ep=1")
    if dims.pp_enabled and dims.tp_enabled:
        raise UsageError(f"ep ({dims.ep}) with pp ({dims.pp}) and tp ({dims.tp}) together is not supported: use "
                         f"pp+fsdp+ep (tp=1) or fsdp+tp+ep (pp=1)")


def check_cp(strategy: str, dims: ParallelDims) -> None:
    """Context parallel needs FSDP to sum its ranks' gradients (over dp_shard x cp) and no pipeline."""
    if not dims.cp_enabled:
        return
    if OPTIONS[strategy].data_parallel != "fsdp":
        raise UsageError(f"cp ({dims.cp}) needs an FSDP strategy, which sums the context-parallel ranks' gradients "
                         f"over dp_shard x cp; strategy {strategy} does not: use fsdp+cp, fsdp+tp+cp, fsdp or fsdp+tp")
    if dims.pp_enabled:
        raise UsageError(f"cp ({dims.cp}) with pp ({dims.pp}) is not supported: pipeline stages pass whole sequences; "
                         f"set pp=1 or cp=1")


def check_seq_split(dims: ParallelDims, seq_len: int) -> None:
    """Head-tail context parallel cuts a sequence into 2 x cp equal chunks (times tp under sequence parallel)."""
    if not dims.cp_enabled:
        return
    need = 2 * dims.seq_shards
    if seq_len % need:
        sp = f" x tp ({dims.tp}, sequence parallel)" if dims.sequence_parallel else ""
        raise UsageError(f"seq_len ({seq_len}) must be divisible by 2 x cp ({dims.cp}){sp} = {need}: each context-"
                         f"parallel rank holds 2 equal chunks (head and tail); use a --seq-len that is a multiple "
                         f"of {need}")


def default_microbatches(dims: ParallelDims, asked: int | None) -> int:
    """Pipeline microbatches: as asked, else 2 x pp (enough for every schedule); 1 without a pipeline."""
    if not dims.pp_enabled:
        return asked or 1
    return asked or 2 * dims.pp


def resolve_cell(strategy: str, world: int, degrees: dict | None, size: ModelSize, precision: str, *, pp_schedule: str,
                 microbatches: int | None, grad_accum: int, global_batch: int,
                 sequence_parallel: bool = True) -> tuple[Layout, int]:
    """Resolve a cell's strategy and run every check its shape allows; the layout and the microbatches.

    The planner and the what-if both call it, so a cell is valid for one exactly when it is for
    the other. Each failed check is a UsageError naming the values and the fix.
    """
    layout = resolve(strategy, world, degrees, sequence_parallel)
    check_strategy(precision, strategy)
    mb = default_microbatches(layout.dims, microbatches)
    check_model_fit(layout.dims, size.n_heads, size.d_ff, size.n_layers, pp_schedule, mb, size.kv_heads)
    check_seq_split(layout.dims, size.seq_len)
    check_batch_split(layout.dims, global_batch, mb, grad_accum)
    check_moe(layout.dims, size)
    if layout.dims.pp_enabled:
        check_schedule_layout(strategy, pp_schedule, layout.fsdp)
    return layout, mb


def resolve_own_cell(strategy: str, world: int, degrees: dict | None, own: OwnModel, precision: str, *,
                     grad_accum: int, global_batch: int) -> Layout:
    """:func:`resolve_cell` for a module of your own: data-parallel strategies as for any model, tensor parallel with
    its factory's plan; a pipeline, context and expert parallel split the harness's own layers and are refused."""
    layout = resolve(strategy, world, degrees, sequence_parallel=False)  # its plan says how it shards sequences
    check_strategy(precision, strategy)
    dims = layout.dims
    split = [f"{n} ({getattr(dims, n)})" for n in ("pp", "cp", "ep") if getattr(dims, n) > 1]
    if split:
        raise UsageError(f"{' and '.join(split)} on {own.name} ({own.factory}): a pipeline, context and expert "
                         f"parallel split the harness's own layers, not a module of your own; use ddp, fsdp, zero2, "
                         f"hsdp (or tp with a tp_plan)")
    if dims.tp_enabled and not own.has_tp_plan:
        raise UsageError(f"tp ({dims.tp}) on {own.name}: its factory returned no tp_plan; return tp_plan "
                         f"({{module name: ParallelStyle}}) to shard it, or use a data-parallel strategy")
    check_batch_split(dims, global_batch, 1, grad_accum)
    return layout


def check_moe(dims: ParallelDims, size: ModelSize) -> None:
    """Expert parallel needs experts to split, ``n_experts / ep`` on each rank; an MoE under tp needs expert
    parallel (whose dispatcher reduces the experts' tensor-parallel outputs; the width tp must divide is the
    experts', :func:`check_model_fit`)."""
    if dims.ep_enabled:
        if size.moe is None:
            raise UsageError(f"ep ({dims.ep}) needs a mixture of experts: use --arch moe or an MoE --model, or ep=1")
        if size.moe.n_experts % dims.ep:
            n = size.moe.n_experts
            raise UsageError(f"ep ({dims.ep}) must divide the experts ({n}) of {size.name}: each expert-parallel "
                             f"rank holds n_experts / ep of them; choose ep in {{{_divisors(n)}}}")
    if size.moe is not None and dims.tp_enabled:
        if not dims.ep_enabled:
            raise UsageError(f"tp ({dims.tp}) on a mixture of experts needs expert parallel: the experts are tensor-parallel "
                             f"only inside it; use fsdp+tp+ep (or --degrees with ep > 1)")


def check_batch_split(dims: ParallelDims, global_batch: int, microbatches: int, grad_accum: int) -> None:
    """The global batch must split evenly over the data-parallel ranks and their micro-steps."""
    split = dims.dp * (microbatches if dims.pp_enabled else grad_accum)
    if global_batch % split:
        what = f"dp ({dims.dp}) x microbatches ({microbatches})" if dims.pp_enabled else \
            f"dp ({dims.dp}) x grad_accum ({grad_accum})"
        raise UsageError(f"global batch ({global_batch}) must be divisible by {what} = {split}; "
                         f"use a --batch that is a multiple of {split}")


def world_for(strategy: str, gpus: int) -> int:
    """Devices a strategy's cell uses: ``single`` always runs on one."""
    return 1 if strategy == "single" else gpus


def _divisors(n: int) -> str:
    return ", ".join(str(t) for t in range(1, n + 1) if n % t == 0)


def check_model_fit(dims: ParallelDims, n_heads: int, d_ff: int, n_layers: int, pp_schedule: str, microbatches: int,
                    n_kv_heads: int | None = None) -> None:
    """Checks that need the workload's shape; each error names the values and the fix."""
    if dims.tp_enabled:
        if n_heads % dims.tp:
            raise UsageError(f"tp ({dims.tp}) must divide n_heads ({n_heads}); choose tp in {{{_divisors(n_heads)}}}")
        if n_kv_heads and n_kv_heads % dims.tp:
            raise UsageError(f"tp ({dims.tp}) must divide n_kv_heads ({n_kv_heads}): grouped-query attention shards "
                             f"whole key/value heads; choose tp in {{{_divisors(n_kv_heads)}}}")
        if d_ff % dims.tp:
            raise UsageError(f"tp ({dims.tp}) must divide the MLP width ({d_ff}); choose a tp that divides {d_ff}")
    if dims.pp_enabled:
        check_pipeline(dims.pp, n_layers, pp_schedule, microbatches)
