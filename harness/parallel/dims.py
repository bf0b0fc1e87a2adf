"""One validated object for the parallel degrees (torchtitan ``parallel_dims.py`` style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.errors import UsageError

# Mesh dimension order, outermost first: pipeline stages talk least often, tensor parallel most,
# so tp is innermost (adjacent ranks, NVLink on a node) and pp outermost. Context parallel gathers
# keys and values every layer: inside the data-parallel dimensions, outside tp (torchtitan's order).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FSDP_SHARD_DIM = "dp_shard_cp"
"""The flattened (dp_shard, cp) mesh dimension FSDP shards over: CP ranks hold different tokens of the
same sequences, so their gradients are summed like data-parallel ones (torchtitan's ``dp_shard_cp``)."""
EP_MESH_ORDER = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
"""Under expert parallel dp_shard is built as two dimensions, ``efsdp`` (outer) x ``ep`` (inner, adjacent
ranks: the all-to-all is the busiest exchange), flattened back to ``dp_shard`` for every other layer."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    """Replicas with full gradients all-reduced (DDP, or HSDP's outer dimension)."""
    dp_shard: int = 1
    """FSDP2 shards (``fully_shard``), or HSDP's inner dimension."""
    tp: int = 1
    """Tensor-parallel degree (DTensor column/row plans)."""
    pp: int = 1
    """Pipeline stages (one per rank; interleaved schedules hold several per rank)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over ``cp`` ranks (:mod:`harness.parallel.cp`)."""
    world_size: int = 1
    sequence_parallel: bool = False
    """Shard LayerNorm/residual activations along the sequence under tp (Korthikanti et al. 2022)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ``ep`` ranks borrowed from dp_shard
    (Megatron's EP within DP; ``dp_shard = efsdp x ep``), the experts FSDP-sharded over the remaining
    ``efsdp``. Tokens reach their experts by all-to-all (:mod:`harness.parallel.ep`)."""
    _mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    _fsdp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    _dp_shard_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """Under expert parallel, dp_shard is the flattened (efsdp, ep): kept, like the FSDP mesh."""

    def __post_init__(self) -> None:
        for name in MESH_ORDER:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be a positive integer, got {v!r}")
        prod = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if prod != self.world_size:
            cp = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise UsageError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x tp ({self.tp}) "
                f"x pp ({self.pp}){cp} = {prod} must equal the world size ({self.world_size}); "
                f"change the degrees or --gpus"
            )
        if not isinstance(self.ep, int) or self.ep < 1:
            raise UsageError(f"ep must be a positive integer, got {self.ep!r}")
        if self.dp_shard % self.ep:
            raise UsageError(f"ep ({self.ep}) must divide dp_shard ({self.dp_shard}): expert-parallel ranks are "
                             f"borrowed from the FSDP shards (dp_shard = efsdp x ep); choose ep in "
                             f"{{{', '.join(str(e) for e in range(1, self.dp_shard + 1) if self.dp_shard % e == 0)}}}")
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("sequence parallel needs tp > 1, got tp=1; use strategy tp-sp with --gpus >= 2")

    @property
    def loss_parallel(self) -> bool:
        """Whether the LM head keeps its logits sharded over the vocabulary for a vocabulary-parallel cross-entropy:
        with sequence parallel, as torchtitan pairs them (the logits are the largest activation of a step)."""
        return self.sequence_parallel

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks each expert-parallel shard of the experts is FSDP-sharded over: dp_shard / ep."""
        return self.dp_shard // self.ep

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def seq_shards(self) -> int:
        """Ways one sequence's tokens are split per rank: cp, times tp under sequence parallel."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    def degrees(self) -> dict[str, int]:
        """The degrees by name; ``cp`` and ``ep`` only when used, and ``sp: 1`` under sequence parallel, so
        layouts without them keep their records (and fingerprints)."""
        out = {k: v for k, v in asdict(self).items()
               if (k in MESH_ORDER and k != "cp") or (k in ("cp", "ep") and v > 1)}
        return {**out, "sp": 1} if self.sequence_parallel else out

    def build_mesh(self, device_type: str):
        """Build the device mesh over all dimensions (size-1 ones included, so names always resolve)."""
        if self.ep_enabled:
            sizes = {**{n: getattr(self, n) for n in MESH_ORDER}, "efsdp": self.efsdp, "ep": self.ep}
            mesh = init_device_mesh(device_type, tuple(sizes[n] for n in EP_MESH_ORDER), mesh_dim_names=EP_MESH_ORDER)
            object.__setattr__(self, "_dp_shard_mesh", mesh["efsdp", "ep"]._flatten("dp_shard"))
            fsdp_mesh = mesh["efsdp", "ep", "cp"]._flatten(FSDP_SHARD_DIM)
        else:
            mesh = init_device_mesh(device_type, tuple(getattr(self, n) for n in MESH_ORDER), mesh_dim_names=MESH_ORDER)
            fsdp_mesh = mesh["dp_shard", "cp"]._flatten(FSDP_SHARD_DIM)
        object.__setattr__(self, "_mesh", mesh)
        # kept, not sliced from the root again (torch deprecates slicing a flattened dimension)
        object.__setattr__(self, "_fsdp_mesh", fsdp_mesh)
        return mesh

    def mesh(self, *names: str):
        """A sub-mesh by name, e.g. ``mesh("tp")``, ``mesh("dp_replicate", "dp_shard")`` or ``mesh("dp_shard_cp")``."""
        if self._mesh is None:
            raise RuntimeError("build_mesh() must be called before mesh()")
        if names == (FSDP_SHARD_DIM,):
            return self._fsdp_mesh
        if names == ("dp_shard",) and self._dp_shard_mesh is not None:
            return self._dp_shard_mesh
        return self._mesh[names if len(names) > 1 else names[0]]
