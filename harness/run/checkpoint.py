"""What a checkpoint costs a cell: model and optimizer state saved through ``torch.distributed.checkpoint`` every N
measured steps, sharded as the layout holds it, and one restore checked against the steps it replays.

``--checkpoint sync`` saves with ``dcp.save``: the step that saves waits for the whole write. ``async`` saves
with ``dcp.async_save``: the step waits while the state is staged (copied off the training tensors), the write
runs in a thread on its own gloo group (as torchtitan's async checkpointing does, so its collectives never
interleave with the training step's), and a save still writing when the next is due is waited for first.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harness.spec import CHECKPOINT_MODES


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

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, root: Path, mode: str, every: int):
        if mode not in CHECKPOINT_MODES[1:] or every < 1:
            raise ValueError(f"checkpoint mode {mode!r} every {every}: mode sync or async, every >= 1")
        self.model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self.optimizer, self.root, self.mode, self.every = optimizer, root, mode, every
        self.rank = dist.get_rank()
        # async: the background write's collectives on a group of their own (a collective call: every rank builds it)
        self.group = dist.new_group(backend="gloo") if mode == "async" else None
        self.log = CheckpointLog(mode=mode, every=every)
        self._pending: tuple[Any, float, Save] | None = None

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def due(self, measured: int) -> bool:
        """Whether the ``measured``-th measured step (1-based) ends with a save."""
        return measured % self.every == 0

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int) -> Save:
        """Save the state after ``step``; returns the save (its blocking seconds known, an async write's not yet)."""
        t0 = time.perf_counter()
        self.wait()  # an async save still writing is waited for before the next starts
        path = self.path(step)
        if self.mode == "sync":
            dcp.save(self._state(), checkpoint_id=str(path))
            save = Save(step=step, blocking_s=time.perf_counter() - t0, bytes_written=rank_bytes(path, self.rank))
        else:
            future = dcp.async_save(self._state(), checkpoint_id=str(path), process_group=self.group)
            save = Save(step=step, blocking_s=time.perf_counter() - t0)
            self._pending = (future, t0, save)
        self.log.saves.append(save)
        return save

    def wait(self) -> None:
        """Wait for an async save still writing; its background seconds and bytes are then known."""
        if self._pending is None:
            return
        future, t0, save = self._pending
        self._pending = None
        # torch returns a Future, or (newer) an AsyncSaveResponse whose upload_completion is the write's
        getattr(future, "upload_completion", future).result()
        save.background_s = time.perf_counter() - t0
        save.bytes_written = rank_bytes(self.path(save.step), self.rank)

    def load(self, step: int) -> dict[str, float]:
        """Load the save taken after ``step`` into the model and optimizer: seconds and this rank's bytes read."""
        self.wait()
        t0 = time.perf_counter()
        state = self._state()
        groups = copy.deepcopy(state["optim"]["param_groups"])  # DCP loads into the same objects
        dcp.load(state, checkpoint_id=str(self.path(step)))
        # The hyperparameters stay the live ones (the cell's; the step sets the LR): on torch 2.13 a DCP round trip
        # of a two-stage pipeline rank's param_groups lost AdamW's 'betas' in set_state_dict (rank 0 of 2, KeyError
        # at the next step); the moments and step counts are what a save must bring back.
        state["optim"]["param_groups"] = groups
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return {"load_s": time.perf_counter() - t0, "bytes_read": rank_bytes(self.path(step), self.rank)}

    def replay_step(self, last_step: int) -> int | None:
        """The newest save with steps after it up to ``last_step`` (None without one): the restore check's start."""
        steps = [s.step for s in self.log.saves if s.step < last_step]
        return max(steps) if steps else None

    def remove(self) -> None:
        """The saves are measurements, not results: their folder goes once every rank is done with it."""
        self.wait()
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
