"""What the user asked for, typed: the sweep matrix (:class:`SweepSpec`) and one cell of it
(:class:`CellConfig`), the unit the harness plans, launches and records.

Precedence: CLI flags > sweep file > these defaults. A cell is immutable once planned; it
travels to the ranks as JSON (never pickle).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from harness.errors import UsageError
from harness.parallel.activation_checkpoint import ac_policy
from harness.parallel.levers import OPTIMIZERS
from harness.parallel.presets import SP_NAMED, STRATEGIES, Layout, resolve
from harness.parallel.schedules import PP_SCHEDULES
from harness.precision import FP8_RECIPES, PRECISIONS, Fp8Options, PrecisionPlan
from harness.scaling import LR_RULES, SCALINGS
from workloads.moe import ROUTINGS
from workloads.own_model import OwnModel
from workloads.resolve import OWN_ARCHS, config_workload, workload_of
from workloads.sizes import ARCHS, DEFAULT_ARCH, ModelSize, get_size, size_key, size_label


def _default_seq_len(c: dict) -> int | None:
    """The size's own sequence length (raw dicts from before the arch axis are gpt2); None for an
    unknown size or family, whose id then carries no sequence part."""
    try:
        return config_workload(c).seq_len
    except (KeyError, ValueError):
        return None


CHECKPOINT_MODES = ("off", "sync", "async", "async-pinned")
"""``--checkpoint``: no saves; ``dcp.save`` (the step waits for the write); ``dcp.async_save`` (it waits for the
state to be staged, the write runs beside training); ``async-pinned`` the same, staged by DCP's ``DefaultStager``
into pinned host memory it keeps between saves (GPUs only) (:mod:`harness.run.checkpoint`)."""


def cell_id_of(c: dict) -> str:
    """Readable and unique within a sweep: every field that varies in a matrix appears.

    Takes the raw fields, so a cell that failed validation gets the id it would have had.
    """
    batch = "bauto" if c.get("batch_auto") else f"gb{c['global_batch']}"  # auto: the id is known before the batch
    parts = [size_label(c), c["strategy"], c["precision"], f"w{c['world_size']}", batch, c["scaling"]]
    if c["lr_rule"] != "none":
        parts.append(f"lr-{c['lr_rule']}")
    if str(c["strategy"]).startswith("pp"):
        parts.append(f"{c['pp_schedule']}-m{c['microbatches']}")
    if c["grad_accum"] > 1:
        parts.append(f"ga{c['grad_accum']}")
    # the levers, when pulled (a cell without them keeps the id it always had)
    if c.get("compile"):
        parts.append("compile")
    if c.get("ac", "none") != "none":
        parts.append(f"ac-{c['ac']}")
    if c.get("optimizer", "adamw") != "adamw":
        parts.append(c["optimizer"])
    # a sequence length other than the size's own (a cell at the default keeps the id it always had)
    default_seq = _default_seq_len(c)
    if default_seq is not None and c.get("seq_len") not in (None, default_seq):
        parts.append(f"s{c['seq_len']}")
    if c.get("moe_routing", "learned") != "learned":
        parts.append(f"route-{c['moe_routing']}")
    if not c.get("sequence_parallel", True) and _tp_hybrid(c):
        parts.append("nosp")  # tensor parallel without sequence parallel, where a hybrid runs it by default
    ep = (c.get("degrees") or {}).get("ep", 1)
    if ep > 1:  # an expert-parallel degree asked for (the preset's, ep = every shard, keeps the plain id)
        parts.append(f"ep{ep}")
    if c.get("fp8_recipe", "tensorwise") != "tensorwise":
        parts.append(c["fp8_recipe"].replace("_", "-"))
    if c.get("fp8_all_gather"):
        parts.append("fp8ag")
    if c.get("checkpoint", "off") != "off":
        parts.append(f"ckpt-{c['checkpoint']}{c.get('checkpoint_every', 5)}")
    if c.get("restore_from"):  # started from another run's save: "from" and its step (the save's folder name)
        parts.append("from" + Path(c["restore_from"]).name.removeprefix("step-").lstrip("0"))
    return "-".join(str(p) for p in parts)


def _tp_hybrid(c: dict) -> bool:
    """Whether a cell's layout has tensor parallel whose sequence parallel is not named by the strategy
    (:data:`harness.parallel.presets.SP_NAMED`): a ``+tp`` preset, or ``--degrees`` with tp > 1."""
    if c["strategy"] in SP_NAMED:
        return False
    return "+tp" in c["strategy"] or (c.get("degrees") or {}).get("tp", 1) > 1


@dataclass(frozen=True)
class CellConfig:
    size: str
    """Workload size name (``harness workloads`` lists them)."""
    strategy: str
    """Parallel strategy preset (``single``, ``ddp``, ``fsdp``, ...)."""
    precision: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16``: required, never inferred."""
    world_size: int
    """Devices (ranks) this cell runs on, over all nodes."""
    global_batch: int
    """Sequences per optimizer step over all data-parallel ranks (equal work across strategies)."""
    seq_len: int
    steps: int
    """Measured steps (stored as raw samples)."""
    warmup: int
    """Steps run first and never counted."""
    device_kind: str
    """``cuda`` (NCCL, CUDA events) or ``cpu`` (gloo, perf_counter)."""
    nnodes: int = 1
    grad_accum: int = 1
    """Gradient-accumulation micro-steps per optimizer step (non-pipeline strategies)."""
    microbatches: int = 1
    """Pipeline microbatches per step (pipeline strategies)."""
    pp_schedule: str = "1f1b"
    scaling: str = "strong"
    lr_rule: str = "none"
    base_lr: float = 1e-3
    base_batch: int = 8
    """Global batch at which ``base_lr`` holds; the LR rules scale from it."""
    lr: float = 1e-3
    """Effective peak LR after the rule (derived by the planner, recorded)."""
    lr_warmup_steps: int = 0
    seed: int = 0
    target_loss: float | None = None
    """Loss for steps-to-target; None = entropy floor + the default margin."""
    nvtx: bool = True
    profile: bool = False
    profile_ranks: tuple[int, ...] = (0, 1)
    monitor_hz: float = 10.0
    degrees: dict | None = None
    """Explicit degrees overriding the preset, e.g. ``{"pp": 2, "tp": 2}`` (unnamed ones are 1)."""
    mem_cap_gib: float | None = None
    """CPU only: cap each rank's address-space growth; exceeding it makes the cell ``oom``."""
    compile: bool = False
    """``torch.compile`` per transformer block (:mod:`harness.parallel.levers`)."""
    ac: str = "none"
    """Activation checkpointing policy (:mod:`harness.parallel.activation_checkpoint`): ``none``, ``attn``
    (the attention core; ``selective`` in older records), ``op`` (per-op), ``layerN`` or ``full``."""
    optimizer: str = "adamw"
    """``adamw`` (torch's default kernel) or ``adamw-fused``."""
    batch_auto: bool = False
    """``--batch auto``: the sweep searches the largest batch per rank that fits (:mod:`harness.run.batch_search`)
    and runs the cell at it; ``global_batch`` is then the batch found."""
    arch: str = DEFAULT_ARCH
    """Architecture family (:mod:`workloads.sizes`): ``gpt2``, ``llama3`` or ``moe``; ``config`` for a model read from
    a ``config.json``, ``module`` for a factory's ``nn.Module`` (``model`` holds either)."""
    model: dict | None = None
    """A config model's source (:meth:`workloads.architecture.ModelOrigin.as_dict`: its name, digest, the shrink it
    runs under, notes and the config's content): what rebuilds the workload without the file. None for a built-in
    size."""
    moe_routing: str = "learned"
    """An MoE's routing (:mod:`workloads.moe`): ``learned`` (top-k of the router's scores) or ``balanced``
    (a round robin: every expert gets the same load, the best case)."""
    sequence_parallel: bool = True
    """Sequence parallel wherever the layout has tensor parallel (torchtitan's and Megatron's default): the
    norms and the residual stream sharded along the sequence; False (``--sp off``) runs the textbook TP. The
    ``tp`` and ``tp-sp`` presets say it by name (:func:`harness.parallel.presets.sp_of`)."""
    fp8_recipe: str = "tensorwise"
    """``--precision fp8``: torchao's scaling recipe (:data:`harness.precision.FP8_RECIPES`)."""
    fp8_all_gather: bool = False
    """``--precision fp8`` under FSDP: the converted weights all-gathered in float8."""
    fp8_emulate: bool = False
    """``--precision fp8`` without FP8 tensor cores (a CPU always, a GPU with ``--fp8-emulate``): torchao's
    emulation; the throughput is labelled emulated and never priced as fp8."""
    checkpoint: str = "off"
    """Model and optimizer state saved through ``torch.distributed.checkpoint`` (:data:`CHECKPOINT_MODES`)."""
    checkpoint_every: int = 5
    """With ``checkpoint`` on: a save after every this many measured steps."""
    checkpoint_keep: bool = False
    """With ``checkpoint`` on: the saves stay in the cell's folder, with its loss curve (for ``restore_from``)."""
    restore_from: str | None = None
    """A save of another run (its ``step-NNNNNN`` folder): the cell starts from that state, any layout's, on the
    steps after it (:mod:`harness.run.resume`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ac", ac_policy(self.ac))  # a policy's earlier name reads as today's
        checks = (
            (self.strategy, STRATEGIES, "strategy"),
            (self.precision, PRECISIONS, "precision"),
            (self.pp_schedule, PP_SCHEDULES, "pipeline schedule"),
            (self.scaling, SCALINGS, "scaling"),
            (self.lr_rule, LR_RULES, "LR rule"),
            (self.device_kind, ("cpu", "cuda"), "device kind"),
            (self.optimizer, OPTIMIZERS, "optimizer"),
            (self.arch, ARCHS + OWN_ARCHS, "architecture"),
            (self.moe_routing, ROUTINGS, "MoE routing"),
            (self.fp8_recipe, FP8_RECIPES, "fp8 recipe"),
            (self.checkpoint, CHECKPOINT_MODES, "checkpoint mode"),
        )
        for value, valid, what in checks:
            if value not in valid:
                raise UsageError(f"unknown {what} {value!r}; choose from {', '.join(valid)}")
        for name in ("world_size", "global_batch", "seq_len", "steps", "grad_accum", "microbatches", "nnodes",
                     "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        if self.warmup < 0:
            raise UsageError(f"warmup must be >= 0, got {self.warmup}")
        if self.checkpoint_keep and self.checkpoint == "off":
            raise UsageError("checkpoint_keep keeps the saves of a cell that checkpoints, and this one has checkpoint "
                             "off: add --checkpoint sync or async, or drop --checkpoint-keep")
        if self.arch in OWN_ARCHS and self.model is None:
            raise UsageError(f"arch {self.arch} needs the model it names (the cell config's model); give --model")
        if self.moe_routing != "learned" and self.workload.moe is None:
            raise UsageError(f"moe_routing {self.moe_routing!r} routes an MoE's tokens, and {self.size} has no "
                             f"experts: use --arch moe or an MoE --model, or drop --moe-routing")
        if self.precision != "fp8" and (self.fp8_recipe != "tensorwise" or self.fp8_all_gather or self.fp8_emulate):
            raise UsageError(f"fp8 options (recipe {self.fp8_recipe}, all-gather {self.fp8_all_gather}, emulate "
                             f"{self.fp8_emulate}) need precision fp8, and this cell is {self.precision}")

    @property
    def precision_plan(self) -> PrecisionPlan:
        """The cell's precision with its fp8 options."""
        return PrecisionPlan(self.precision, Fp8Options(self.fp8_recipe, self.fp8_all_gather, self.fp8_emulate))

    @property
    def cell_id(self) -> str:
        return cell_id_of(asdict(self))

    @property
    def layout(self) -> Layout:
        """The strategy resolved at this world size (:func:`harness.parallel.presets.resolve`)."""
        return resolve(self.strategy, self.world_size, self.degrees, self.sequence_parallel)

    @property
    def workload(self) -> ModelSize | OwnModel:
        """The workload this cell names (:func:`workloads.resolve.workload_of`), at its own sequence length."""
        return workload_of(self.size, self.arch, self.model)

    @property
    def model_size(self) -> ModelSize | OwnModel:
        """The workload at this cell's sequence length (a module of your own trains at its factory's)."""
        w = self.workload
        return w if isinstance(w, OwnModel) else replace(w, seq_len=self.seq_len)

    @property
    def workload_key(self) -> str:
        """The size's name unique over families (``tiny``, ``llama3-tiny``): calibration entries are keyed by it."""
        return size_key(self.arch, self.size)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict:
        d = asdict(self)
        d["profile_ranks"] = list(self.profile_ranks)
        if d["model"] is None:  # a built-in size's record keeps the config it always had
            del d["model"]
        return d

    @classmethod
    def from_record(cls, config: dict) -> CellConfig:
        """The config of a record (its ``config``, degrees resolved). A record from before ``sequence_parallel``
        was a field ran every hybrid without it (only ``tp-sp`` had it, by name)."""
        return cls.from_dict({"sequence_parallel": False, **config})

    @classmethod
    def from_dict(cls, d: dict) -> CellConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise UsageError(f"unknown cell config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        d = dict(d)
        if "profile_ranks" in d:
            d["profile_ranks"] = tuple(d["profile_ranks"])
        return cls(**d)


@dataclass(frozen=True)
class SweepSpec:
    """The matrix: sizes x sequence lengths x strategies x precisions x scalings x LR rules x device counts x levers."""

    sizes: tuple[str, ...]
    strategies: tuple[str, ...]
    precisions: tuple[str, ...]
    gpus: tuple[int, ...]
    """Device counts per node to sweep (``--gpus 1,2,4``)."""
    device_kind: str
    batch: int
    """Sequences per step: global under strong scaling, per device under weak scaling."""
    steps: int
    warmup: int
    scalings: tuple[str, ...] = ("strong",)
    lr_rules: tuple[str, ...] = ("none",)
    batch_auto: bool = False
    """``--batch auto``: each cell searches its batch per device (weak scaling only)."""
    compiles: tuple[bool, ...] = (False,)
    acs: tuple[str, ...] = ("none",)
    """Activation checkpointing policies to sweep (``--ac none,op,full``)."""
    optimizers: tuple[str, ...] = ("adamw",)
    archs: tuple[str, ...] = (DEFAULT_ARCH,)
    seq_lens: tuple[int | None, ...] = (None,)
    """Sequence lengths to sweep (``--seq-len 256,512``); None: each size's own."""
    moe_routings: tuple[str, ...] = ("learned",)
    """MoE routings to sweep (``--moe-routing learned,balanced``); dense families take ``learned`` only."""
    sequence_parallels: tuple[bool, ...] = (True,)
    """Sequence parallel where tensor parallel is (``--sp on,off``); a layout without tp takes the first only."""
    fp8_recipes: tuple[str, ...] = ("tensorwise",)
    """fp8 scaling recipes to sweep (``--fp8-recipe tensorwise,rowwise``); other precisions take none."""
    fp8_all_gathers: tuple[bool, ...] = (False,)
    """FSDP's float8 all-gather off and/or on (``--fp8-all-gather off,on``); layouts without FSDP take off."""
    fp8_emulate: bool = False
    """``--fp8-emulate``: a GPU without FP8 tensor cores runs fp8 as torchao's emulation (a CPU always does)."""
    checkpoints: tuple[str, ...] = ("off",)
    """Checkpoint modes to sweep (``--checkpoint off,sync,async``)."""
    checkpoint_every: int = 5
    """``--checkpoint-every``: measured steps between saves."""
    checkpoint_keep: bool = False
    """``--checkpoint-keep``: the saves stay in each cell's folder (a ``--restore-from`` source)."""
    restore_from: str | None = None
    """``--restore-from``: every cell starts from this save (:mod:`harness.run.resume`)."""
    microbatches: int | None = None
    """Pipeline microbatches; default 2 x pp (enough for every schedule)."""
    pp_schedules: tuple[str, ...] = ("1f1b",)
    """Pipeline schedules to sweep (``--pp-schedule 1f1b,zb``); a layout without a pipeline takes the first only."""
    grad_accum: int = 1
    base_lr: float = 1e-3
    base_batch: int | None = None
    """Batch at which base_lr holds; default: ``batch`` (the one-device batch)."""
    lr_warmup_steps: int = 0
    seed: int = 0
    target_loss: float | None = None
    nnodes: int = 1
    nvtx: bool = True
    monitor_hz: float = 10.0
    """Monitor sampling rate over the measured window; 0: no monitor thread."""
    profile: bool = False
    mem_cap_gib: float | None = None
    degrees: dict | None = None
    reference: bool = True
    """Add the single-device cell of each group when the strategies leave it out: the parity
    reference (strong scaling) and the one-device baseline of scaling efficiency."""
    force: bool = False
    """Run cells the model predicts will not fit in a rank's memory (they are invalid otherwise)."""
    extra: dict = field(default_factory=dict)
    models: tuple[ModelSize | OwnModel, ...] = ()
    """``--model``: the user's own models, resolved where the sweep is read; when given, ``sizes`` and ``archs``
    are not swept."""

    @property
    def workloads(self) -> tuple[ModelSize | OwnModel, ...]:
        """Every workload of the sweep, as values: the ``--model`` ones, or each family's named sizes (one lookup,
        here; UsageError naming an unknown size and the family's names)."""
        if self.models:
            return self.models
        try:
            return tuple(get_size(name, arch) for arch in self.archs for name in self.sizes)
        except ValueError as e:
            raise UsageError(f"--sizes: {e}") from None


def default_device_kind() -> str:
    """``cuda`` when a GPU is visible (and ``HARNESS_FORCE_CPU`` is not 1), else ``cpu``."""
    return "cuda" if torch.cuda.is_available() and os.environ.get("HARNESS_FORCE_CPU") != "1" else "cpu"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what Slurm's binding, ``taskset`` or a container's cpuset
    leave it), not the machine's count (``os.cpu_count``), which would oversubscribe the cores it has."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS): the machine's count
        return max(1, os.cpu_count() or 1)


def threads_per_rank(local_world: int) -> int:
    """CPU threads each of a node's ``local_world`` ranks runs with: the usable cores shared out, at least one.

    The worker sets it, and calibrations are keyed by it, so predictions find the matching entry.
    """
    return max(1, usable_cores() // max(1, local_world))
