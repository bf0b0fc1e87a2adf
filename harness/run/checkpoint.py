"""What a checkpoint costs a cell: model and optimizer state saved through ``torch.distributed.checkpoint`` every N
measured steps, sharded as the layout holds it, and one restore checked against the steps it replays.

``--checkpoint sync`` saves with ``dcp.save``: the step that saves waits for the whole write. ``async`` saves
with ``dcp.async_save``: the step waits while the state is staged (copied off the training tensors), the write
runs in a thread on its own gloo group (as torchtitan's async checkpointing does, so its collectives never
interleave with the training step's), and a save still writing when the next is due is waited for first.
``async-pinned`` (GPUs) stages through DCP's ``DefaultStager`` into pinned host memory kept between saves.
The model and optimizer state dicts are torch's own (``get_state_dict``: FSDP's and TP's DTensors stay shards;
a pipeline rank saves the stages it holds).

Each save has its own directory (``checkpoints/step-<k>`` in the cell's folder); a rank's bytes are the files DCP
wrote for it (``__<rank>_*.distcp``). After the measured window the newest save with steps after it is loaded
back and those steps are run again on the same batches: their losses must equal the ones recorded the first
time (the restore check). The folder is removed once the cell is measured.
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harness.run import train
from harness.run.cell_build import Batches
from harness.run.resume import STEP_DIR, Progress, Start, find_start
from harness.spec import CHECKPOINT_MODES, CellConfig


@dataclass
class Save:
    """One save on this rank."""

    step: int
    """The step (0-based, warmup included) after which it was taken."""
    blocking_s: float
    """Seconds the training loop waited for it: the whole write (sync), or staging and any earlier save still
    writing (async)."""
    background_s: float | None = None
    """async: seconds from the save's start until its write finished."""
    bytes_written: int = 0


@dataclass
class CheckpointLog:
    """This rank's saves and its restore check, as the worker gathers them (JSON)."""

    mode: str
    every: int
    saves: list[Save] = field(default_factory=list)
    restore: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def rank_bytes(path: Path, rank: int) -> int:
    """Bytes DCP's file writer wrote for ``rank`` under ``path`` (its ``__<rank>_<i>.distcp`` files)."""
    return sum(f.stat().st_size for f in path.glob(f"__{rank}_*.distcp"))


class Checkpointer:
    """Saves, waits for and restores this rank's training state (``parts``: the modules it trains)."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, root: Path, mode: str, every: int,
                 scaler: torch.amp.GradScaler | None = None):
        if mode not in CHECKPOINT_MODES[1:] or every < 1:
            raise ValueError(f"checkpoint mode {mode!r} every {every}: mode {', '.join(CHECKPOINT_MODES[1:])}, "
                             f"every >= 1")
        self.model = model_of(parts)
        self.optimizer, self.root, self.mode, self.every, self.scaler = optimizer, root, mode, every, scaler
        self.rank = dist.get_rank()
        # async: the background write's collectives on a group of their own (a collective call: every rank builds it)
        self.group = dist.new_group(backend="gloo") if mode.startswith("async") else None
        self.stager = _pinned_stager() if mode == "async-pinned" else None
        self.log = CheckpointLog(mode=mode, every=every)
        self._pending: tuple[Any, float, Save, Progress] | None = None

    def path(self, step: int) -> Path:
        return self.root / STEP_DIR.format(step)

    def due(self, measured: int) -> bool:
        """Whether the ``measured``-th measured step (1-based) ends with a save."""
        return measured % self.every == 0

    def _state(self) -> dict[str, Any]:
        return training_state(self.model, self.optimizer, self.scaler)

    def save(self, step: int, progress: Progress) -> Save:
        """Save the state after ``step``; returns the save (its blocking seconds known, an async write's not yet).
        ``progress``: this rank's :class:`harness.run.resume.Progress` at the save, written once the save is
        complete (what a resumed attempt takes over)."""
        t0 = time.perf_counter()
        self.wait()  # an async save still writing is waited for before the next starts
        path = self.path(step)
        if self.mode == "sync":
            dcp.save(self._state(), checkpoint_id=str(path))
            save = Save(step=step, blocking_s=time.perf_counter() - t0, bytes_written=rank_bytes(path, self.rank))
            replace(progress, saved_at=time.time()).write(path, self.rank)
        else:
            future = dcp.async_save(self._state(), checkpoint_id=str(path), process_group=self.group,
                                    async_stager=self.stager)
            staged = getattr(future, "staging_completion", None)
            if staged is not None:  # the next step may not change the state before its copy is taken
                staged.result()
            save = Save(step=step, blocking_s=time.perf_counter() - t0)
            self._pending = (future, t0, save, progress)
        self.log.saves.append(save)
        return save

    def wait(self) -> None:
        """Wait for an async save still writing; its background seconds and bytes are then known."""
        if self._pending is None:
            return
        future, t0, save, progress = self._pending
        self._pending = None
        # torch returns a Future, or (newer) an AsyncSaveResponse whose upload_completion is the write's
        getattr(future, "upload_completion", future).result()
        save.background_s = time.perf_counter() - t0
        save.bytes_written = rank_bytes(self.path(save.step), self.rank)
        replace(progress, saved_at=time.time()).write(self.path(save.step), self.rank)

    def load(self, path: Path) -> dict[str, float]:
        """Load the save at ``path`` into the model and optimizer: seconds and this rank's bytes read."""
        self.wait()
        return load_state(self.model, self.optimizer, path, self.rank, self.scaler)

    def replay_step(self, last_step: int) -> int | None:
        """The newest save with steps after it up to ``last_step`` (None without one): the restore check's start."""
        steps = [s.step for s in self.log.saves if s.step < last_step]
        return max(steps) if steps else None

    def restore_check(self, ctx: train.StepContext, batches: Batches, losses: list[float | None], last: int) -> None:
        """Load the newest save with steps after it and run those steps again on the same batches: their losses
        must be ``losses`` (the window's, this rank's where it has the loss). The state ends where it was."""
        start = self.replay_step(last)
        if start is None:
            return
        loaded = self.load(self.path(start))
        diffs = []
        for step in range(start + 1, last + 1):
            loss, _ = train.train_step(ctx, *batches(step), batches.lr(step))
            first = losses[step]
            if loss is not None and first is not None:
                diffs.append(abs(float(loss) - first))
        self.log.restore = {"from_step": start, "steps_replayed": last - start, **loaded,
                            "loss_max_abs_diff": max(diffs) if diffs else None}

    def clear_stale(self) -> None:
        """A cell starting at step 0 removes saves an earlier run of it left (a finished cell's kept ones)."""
        dist.barrier()  # every rank has decided where it starts
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        dist.barrier()

    def finish(self, keep: bool) -> None:
        """The saves are measurements, not results: their folder goes once every rank is done with it, unless
        kept (``--checkpoint-keep``: for ``--restore-from``; rank 0 writes the loss curve beside them later)."""
        self.wait()
        dist.barrier()
        if self.rank == 0 and not keep:
            shutil.rmtree(self.root, ignore_errors=True)


def _pinned_stager() -> Any:
    """``async-pinned``: DCP's stager copying the state into pinned host memory it keeps for the next save (as
    torchtitan's ``async_with_pinned_mem``); the copy runs off the training thread, and the save waits for it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415 (torch >= 2.9)

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=True))


def scaler_state(scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    """fp16's loss scale and its growth count as tensors DCP saves (every rank holds the same: written once); none
    without a scaler."""
    if scaler is None:
        return {}
    sd = scaler.state_dict()
    return {"scaler": {"scale": torch.tensor(float(sd["scale"]), dtype=torch.float64),
                       "growth_tracker": torch.tensor(int(sd["_growth_tracker"]), dtype=torch.int64)}}


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None) -> dict[str, Any]:
    """What a save holds and a load fills: torch's model and optimizer state dicts (sharded as the layout holds
    them) and fp16's loss scale."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, **scaler_state(scaler)}


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, rank: int,
               scaler: torch.amp.GradScaler | None = None) -> dict[str, float]:
    """Load the DCP save at ``path`` (any layout's: DCP reshards it into this one) into ``model``, ``optimizer`` and
    fp16's ``scaler``: seconds, and the bytes of this rank's own files in it (its share when the save is of this
    layout; :func:`start_cell` reports a save of another layout by its total instead)."""
    t0 = time.perf_counter()
    state = training_state(model, optimizer, scaler)
    groups = copy.deepcopy(state["optim"]["param_groups"])  # DCP loads into the same objects
    dcp.load(state, checkpoint_id=str(path))
    # The hyperparameters stay the live ones (the cell's; the step sets the LR): on torch 2.13 a DCP round trip
    # of a two-stage pipeline rank's param_groups lost AdamW's 'betas' in set_state_dict (rank 0 of 2, KeyError
    # at the next step); the moments and step counts are what a save must bring back.
    state["optim"]["param_groups"] = groups
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scaler is not None:
        scaler.load_state_dict({**scaler.state_dict(), "scale": state["scaler"]["scale"].item(),
                                "_growth_tracker": int(state["scaler"]["growth_tracker"].item())})
    return {"load_s": time.perf_counter() - t0, "bytes_read": rank_bytes(path, rank)}


def model_of(parts: list[nn.Module]) -> nn.Module:
    """The module whose state a rank saves: its one part, or its pipeline stages together."""
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def start_cell(cfg: CellConfig, parts: list[nn.Module], optimizer: torch.optim.Optimizer, cell_dir: Path,
               scaler: torch.amp.GradScaler | None = None) -> tuple[Checkpointer | None, Start]:
    """The cell's checkpointer (None with ``--checkpoint off``) and where it starts (:func:`harness.run.resume.find_start`),
    the save it starts from loaded (resharded by DCP when another layout took it)."""
    rank = dist.get_rank()
    ckpt = Checkpointer(parts, optimizer, cell_dir / "checkpoints", cfg.checkpoint, cfg.checkpoint_every, scaler) \
        if cfg.checkpoint != "off" else None
    start = find_start(cfg.to_dict(), cell_dir, dist.get_world_size(), rank, psutil.Process().create_time())
    if ckpt is not None and start.kind != "resume":
        ckpt.clear_stale()
    if start.path is not None:
        start.loaded = load_state(model_of(parts), optimizer, start.path, rank, scaler)
        if start.kind == "restore":  # another layout's files: DCP reads the pieces of any it needs
            start.loaded = {"load_s": start.loaded["load_s"],
                            "source_bytes": sum(f.stat().st_size for f in start.path.glob("*.distcp"))}
    return ckpt, start
