"""What one rank role of a ``harness fit`` cell plays, as the parent writes it (JSON) and the role process reads it.

Kept apart from :mod:`harness.fit.role_process`, which imports the whole parallel stack (DTensor, FSDP,
pipelining): the parent plans roles without those imports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

COMPUTE = ("real", "fake")


@dataclass(frozen=True)
class RoleSpec:
    """One rank of one cell, as the role process receives it (JSON)."""

    size: str
    strategy: str
    precision: str
    world_size: int
    rank: int
    micro_batch: int
    """Sequences per data-parallel rank per pipeline microbatch (the whole local batch without a pipeline)."""
    seq_len: int
    microbatches: int
    pp_schedule: str
    steps: int
    """Training steps run; the peak is over all of them (the first allocates the optimizer state)."""
    device_kind: str
    compute: str = "real"
    """``real`` arithmetic, or ``fake`` (``FakeTensorMode``: shapes and allocations only)."""
    degrees: dict | None = None
    ac: str = "none"
    model: dict | None = None
    """A ``--model``'s source (the config it rebuilds the workload from); None for a built-in size."""

    @classmethod
    def from_dict(cls, d: dict) -> RoleSpec:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return asdict(self)
