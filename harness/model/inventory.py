"""Every parameter tensor of :class:`workloads.model.Decoder` (either family), and what one rank holds of it.

Built from the size alone (no model is instantiated), so it works for a 1.3B-parameter model
at 1,024 ranks as fast as for ``tiny``. What a rank holds follows the code that shards it:

* pipeline: stages are contiguous layer ranges (:func:`harness.parallel.schedules.layer_ranges`);
  stage 0 adds the embeddings, the last stage the final norm and LM head; a rank holds
  stages ``r, r + pp, ...`` (one per virtual stage);
* tensor parallel (:mod:`harness.parallel.tp`): q/k/v and the MLP's input linears (fc, or
  gate and up) and their biases, and the LM head are column-parallel (dim 0 / tp), out/proj
  weights row-parallel (dim 1 / tp), their biases, the norms and embeddings replicated;
* FSDP2 ``fully_shard`` (dim 0 of the tp-local tensor, ``torch.chunk`` over ``dp_shard``): rank
  ``i`` holds chunk ``i``; collectives move the padded size (``ceil(dim0 / n)`` rows per rank).
  Each block is one FSDP group, everything else on a stage (embeddings, norm, head) the root group.
* expert parallel (:mod:`harness.parallel.ep`): each MoE layer's stacked experts split along dim 0
  over ``ep``, then FSDP-sharded over ``efsdp`` only, in an FSDP group of their own (an ``efsdp`` of 1
  issues no collective: FSDP2 skips them on a 1-rank mesh).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from harness.parallel.dims import ParallelDims
from harness.parallel.schedules import layer_ranges, placement
from harness.parallel.tp_plan import COLUMN_LINEARS, PROJ_NORMS, ROW_LINEARS
from workloads.meta import on_meta
from workloads.model import Decoder
from workloads.moe import WIDTH_DIM
from workloads.own_model import OwnModel
from workloads.sizes import ModelSize

COL, ROW, REPLICATE = "col", "row", "replicate"


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    layer: int | None
    """Block index, or None for the embeddings (stage 0) and final norm / head (last stage)."""
    tp: str
    """``col`` (dim 0 sharded), ``row`` (dim 1 sharded) or ``replicate`` under tensor parallel."""
    expert: bool = False
    """An MoE layer's stacked experts (dim 0 the expert): split over ep under expert parallel."""

    @property
    def first_stage(self) -> bool:
        return self.name.startswith("embed.")


@functools.lru_cache(maxsize=64)
def param_specs(size: ModelSize | OwnModel) -> tuple[ParamSpec, ...]:
    """Every parameter tensor, in the model's registration order: the module tree itself, built on the meta device
    (no memory, no initialiser run: milliseconds at any size, :func:`workloads.meta.on_meta`), each tensor placed as tensor parallel places it (:func:`tp_of`)."""
    if isinstance(size, OwnModel):
        return _own_specs(size)
    with on_meta():
        model = Decoder(size)
    out = []
    for name, p in model.named_parameters():
        block = _BLOCK.match(name)
        local = name[block.end():] if block else name
        out.append(ParamSpec(name, tuple(p.shape), int(block.group(1)) if block else None,
                             tp_of(local, proj_norm=size.qk_norm == "proj"), expert=local.startswith("mlp.experts.")))
    return tuple(out)


_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def _own_specs(own: OwnModel) -> tuple[ParamSpec, ...]:
    """A module of your own's tensors, each in the block it sits in (FSDP's groups), on the meta device; all
    replicated under tensor parallel, whose plan is the factory's (a tp cell is not priced)."""
    with on_meta():
        module = own.module()
    blocks = [(f"inner.{name}.", i) for i, (name, _) in enumerate(module.block_items())]
    return tuple(ParamSpec(name, tuple(p.shape), next((i for prefix, i in blocks if name.startswith(prefix)), None),
                           REPLICATE) for name, p in module.named_parameters())


def tp_of(local: str, proj_norm: bool = False) -> str:
    """How tensor parallel (:func:`harness.parallel.tp.apply_tp`) places a parameter, by its name inside a block
    (or the model's): a column-parallel linear's weight and bias, the LM head and a q/k norm over the whole
    projection are ``col`` (dim 0 sharded); a row-parallel linear's weight ``row`` (dim 1), its bias replicated;
    the rest (norms, embeddings, the router, MLA's low-rank down-projections, an MoE's experts, which expert
    parallel places) ``replicate``."""
    module, _, leaf = local.rpartition(".")
    if module in COLUMN_LINEARS or local == "head.weight" or (proj_norm and module in PROJ_NORMS):
        return COL
    if module in ROW_LINEARS:
        return ROW if leaf == "weight" else REPLICATE
    return REPLICATE


def tp_local_shape(spec: ParamSpec, tp: int) -> tuple[int, ...]:
    """The tensor-parallel local shape (tp divides the sharded dimension: checked by the planner)."""
    if tp == 1 or spec.tp == REPLICATE:
        return spec.shape
    if spec.tp == COL:
        return (math.ceil(spec.shape[0] / tp),) + spec.shape[1:]
    return (spec.shape[0], math.ceil(spec.shape[1] / tp))


def _ep_split(spec: ParamSpec, dims: ParallelDims) -> bool:
    return spec.expert and dims.ep_enabled


def held_shape(spec: ParamSpec, dims: ParallelDims) -> tuple[int, ...]:
    """What one rank holds before FSDP: the tp-local shape; under ep an expert tensor's ``E / ep`` experts,
    their width (``gate``/``up`` dim 1, ``proj`` dim 2) split over tp."""
    if _ep_split(spec, dims):
        shape = [spec.shape[0] // dims.ep, *spec.shape[1:]]
        shape[WIDTH_DIM[spec.name.rsplit(".", 1)[1]]] //= dims.tp
        return tuple(shape)
    return tp_local_shape(spec, dims.tp)


def fsdp_ways(spec: ParamSpec, dims: ParallelDims) -> int:
    """Ranks FSDP shards ``spec`` over: dp_shard x cp, or efsdp for experts under expert parallel."""
    return dims.efsdp if _ep_split(spec, dims) else dims.fsdp_shards


def held_numel(spec: ParamSpec, dims: ParallelDims, fsdp: bool, coord: RankCoord) -> int:
    """Elements of ``spec`` the rank at ``coord`` holds (FSDP chunk included when ``fsdp``)."""
    if not fsdp:
        return math.prod(held_shape(spec, dims))
    index = coord.dp_shard // dims.ep if _ep_split(spec, dims) else coord.dp_shard
    return fsdp_local_numel(held_shape(spec, dims), fsdp_ways(spec, dims), index)


def _rest(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def fsdp_local_numel(shape: tuple[int, ...], n: int, index: int) -> int:
    """Elements FSDP2 rank ``index`` of ``n`` holds: chunk ``index`` of ``torch.chunk(dim 0, n)``."""
    if n == 1:
        return math.prod(shape)
    rows = math.ceil(shape[0] / n)
    return max(0, min(rows, shape[0] - index * rows)) * _rest(shape)


def fsdp_padded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of the all-gather output / reduce-scatter input for one parameter: dim 0 padded to n chunks."""
    return math.ceil(shape[0] / n) * n * _rest(shape)


def n_stages(dims: ParallelDims, virtual: int) -> int:
    return dims.pp * virtual


@functools.lru_cache(maxsize=256)
def _layer_owner(n_layers: int, stages: int) -> tuple[int, ...]:
    """Stage of each layer (:func:`harness.parallel.schedules.layer_ranges`)."""
    return tuple(s for s, r in enumerate(layer_ranges(n_layers, stages)) for _ in r)


def stage_of(spec: ParamSpec, stages: int, n_layers: int) -> int:
    """The pipeline stage that owns a parameter."""
    if spec.layer is None:
        return 0 if spec.first_stage else stages - 1
    return _layer_owner(n_layers, stages)[spec.layer]


def rank_layers(n_layers: int, pp: int, virtual: int, pp_rank: int, v_shape: bool = False) -> int:
    """Blocks on the stages a pipeline rank holds."""
    return len(rank_layer_ids(n_layers, pp, virtual, pp_rank, v_shape))


def rank_layer_ids(n_layers: int, pp: int, virtual: int, pp_rank: int, v_shape: bool = False) -> list[int]:
    """The model's indices of the blocks on the stages a pipeline rank holds, in order."""
    mine = set(stages_of_rank(pp_rank, pp, virtual, v_shape))
    return [i for i, s in enumerate(_layer_owner(n_layers, pp * virtual)) if s in mine]


def group_of(spec: ParamSpec, dims: ParallelDims | None = None) -> str:
    """FSDP group: one per block, the rest of a stage in the root group; under expert parallel
    (``dims``) each block's experts their own group."""
    if dims is not None and _ep_split(spec, dims):
        return f"block{spec.layer}.experts"
    return f"block{spec.layer}" if spec.layer is not None else "root"


@dataclass(frozen=True)
class RankCoord:
    """A global rank's coordinates on the (pp, dp_replicate, dp_shard, cp, tp) mesh."""

    rank: int
    pp: int
    dp_replicate: int
    dp_shard: int
    """The rank's index among the ranks FSDP shards over: dp_shard x cp flattened, cp innermost
    (the plain dp_shard index without context parallel)."""
    tp: int
    cp: int = 0


def coords(dims: ParallelDims) -> list[RankCoord]:
    """Coordinates of every global rank, in the mesh order of :mod:`harness.parallel.dims`."""
    out = []
    for r in range(dims.world_size):
        rest, t = divmod(r, dims.tp)
        rest, c = divmod(rest, dims.cp)
        rest, s = divmod(rest, dims.dp_shard)
        p, rep = divmod(rest, dims.dp_replicate)
        out.append(RankCoord(r, p, rep, s * dims.cp + c, t, c))
    return out


def stages_of_rank(pp_rank: int, pp: int, virtual: int, v_shape: bool = False) -> list[int]:
    """Stages a pipeline rank holds: looped for interleaved schedules, a V for zbv and dualpipev
    (:func:`harness.parallel.schedules.placement`, what the pipeline builds)."""
    return placement(pp_rank, pp, virtual, v_shape)


def rank_params(size: ModelSize, dims: ParallelDims, virtual: int, pp_rank: int, v_shape: bool = False) -> list[ParamSpec]:
    """Parameters (global specs) on the stages a pipeline rank holds."""
    return list(_stage_params(size, dims.pp, virtual, pp_rank, v_shape))


@functools.lru_cache(maxsize=1024)
def _stage_params(size: ModelSize, pp: int, virtual: int, pp_rank: int, v_shape: bool = False) -> tuple[ParamSpec, ...]:
    mine = set(stages_of_rank(pp_rank, pp, virtual, v_shape))
    return tuple(p for p in param_specs(size) if stage_of(p, pp * virtual, size.n_layers) in mine)
