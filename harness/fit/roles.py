"""Which global ranks hold the same thing, so one process per distinct role measures them all.

Ranks differ in memory by their pipeline rank (the first holds the embeddings, the last the
head and logits, stages may hold different layer counts, and under 1F1B pipeline rank ``p``
keeps ``pp - p`` microbatches' activations in flight: measured on gloo, two middle stages of
pp 4 differ by 14%) and by their FSDP shard (``torch.chunk``
over ``dp_shard`` leaves the last ranks short, or empty, when a dimension does not divide).
Ranks that differ only along ``dp_replicate`` or ``tp`` hold alike (tp divides every sharded
dimension: the planner checks it). The shard sizes come from :mod:`harness.model.inventory`,
the placement rule the model and FSDP2 share.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.model.inventory import coords, held_numel, rank_params, stages_of_rank
from harness.model.shape import CellShape


@dataclass(frozen=True)
class Role:
    rank: int
    """The global rank that plays the role (the lowest of its ranks)."""
    ranks: tuple[int, ...]
    """Every global rank that holds alike."""
    stage: str
    """``all`` without a pipeline, else ``first``, ``middle <pp rank>`` or ``last`` (or ``first+last``,
    ..., for the stages an interleaved rank holds)."""
    shards: tuple[int, ...]
    """The ``dp_shard`` indices of the role's ranks (``(0,)`` without FSDP)."""

    @property
    def name(self) -> str:
        parts = [] if self.stage == "all" else [f"stage {self.stage}"]
        if len(self.shards) > 1 or self.shards != (0,):
            parts.append(f"shard {_ranges(self.shards)}")
        return ", ".join(parts) or "every rank"


def _ranges(xs: tuple[int, ...]) -> str:
    out: list[str] = []
    start: int | None = xs[0]  # None after the last run, where the loop ends
    for a, b in zip(xs, xs[1:] + (None,)):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _stage_kind(pp_rank: int, pp: int, virtual: int, v_shape: bool) -> str:
    if pp == 1:
        return "all"
    n = pp * virtual
    kinds = ["first" if s == 0 else "last" if s == n - 1 else f"middle {pp_rank}"
             for s in stages_of_rank(pp_rank, pp, virtual, v_shape)]
    return "+".join(dict.fromkeys(kinds))


def rank_roles(c: CellShape) -> list[Role]:
    """The cell's roles, in rank order of their first rank."""
    dims = c.dims
    shard = dims.fsdp_shards if c.fsdp else 1
    groups: dict[tuple, list] = {}
    for k in coords(dims):
        kind = _stage_kind(k.pp, dims.pp, c.virtual, c.v_shape)
        specs = rank_params(c.size, dims, c.virtual, k.pp, c.v_shape)
        held = tuple(held_numel(p, dims, shard > 1, k) for p in specs)
        groups.setdefault((kind, held), []).append(k)
    roles = []
    for (kind, _), ks in groups.items():
        shards = tuple(sorted({k.dp_shard for k in ks})) if shard > 1 else (0,)
        roles.append(Role(rank=ks[0].rank, ranks=tuple(k.rank for k in ks), stage=kind, shards=shards))
    return sorted(roles, key=lambda r: r.rank)
