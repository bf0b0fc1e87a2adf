"""Where a cell's training starts, and what a restart cost (pure: files and arithmetic, no torch).

A cell starts at step 0, or from a checkpoint:

- **its own** (a resume): an earlier attempt of the same cell, cut short (Slurm's SIGTERM, a requeue, a crash),
  left a complete save in the cell's folder. The cell loads it and continues its own loss curve from the step
  after it; the steps up to the save are the earlier attempt's (their times, losses and step-1 probe travel with
  the save). The record says from which step it resumed and what the restart cost.
- **another run's** (``--restore-from``): a save kept by another run (``--checkpoint-keep``), of any layout: DCP
  reshards it into this cell's. The cell starts from that state on the data and learning rate of the steps after
  it, and its losses are held against the ones the source recorded for the same steps.

Beside DCP's files each save has one small JSON per rank (``harness-rank<r>.json``, :class:`Progress`), written
once that rank's part of the save is complete; a save is complete when DCP's ``.metadata`` and every rank's file
are there. A cell that keeps its saves writes its whole loss curve (the global loss of every step) beside them when it
ends (``curve.json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.records.atomic import write_json_atomic
from harness.run.heartbeat import LAST_BEAT
from harness.spec import cell_id_of

PROGRESS = "harness-rank{}.json"
CURVE = "curve.json"
STEP_DIR = "step-{:06d}"
SAME_TRAINING = ("arch", "size", "seq_len", "global_batch", "seed", "lr", "lr_warmup_steps", "optimizer")
"""The cell fields a ``--restore-from`` source must share with the cell: the same model, data and update rule,
so its steps after the save are the ones the cell repeats."""


@dataclass(frozen=True)
class Progress:
    """One rank's state at a save: what a resumed attempt takes over from the attempt that saved."""

    step: int
    """The step (0-based, warmup included) after which the save was taken."""
    cell: dict[str, Any]
    """The cell's config (:meth:`harness.spec.CellConfig.to_dict`): a resume takes only its own cell's saves."""
    times: list[float]
    cpu_times: list[float]
    losses: list[float | None]
    """Every step's time, CPU seconds and loss up to the save (None on a pipeline rank without the loss)."""
    probe: dict[str, Any]
    """Step 1's squared norms (the parity probe)."""
    attempts: list[dict[str, float | None]] = field(default_factory=list)
    """Each attempt's ``started_at`` and (all but the running one) ``ended_at``, seconds since the epoch."""
    saved_at: float = 0.0

    @classmethod
    def read(cls, path: Path, rank: int) -> Progress | None:
        f = path / PROGRESS.format(rank)
        return cls(**json.loads(f.read_text())) if f.exists() else None

    def write(self, path: Path, rank: int) -> None:
        write_json_atomic(path / PROGRESS.format(rank), asdict(self))


def is_complete(path: Path, world: int) -> bool:
    """DCP finished the save (its ``.metadata``) and every rank wrote its :class:`Progress`."""
    return (path / ".metadata").exists() and all((path / PROGRESS.format(r)).exists() for r in range(world))


def own_checkpoint(root: Path, cell: dict[str, Any], world: int) -> Path | None:
    """The newest complete save under ``root`` that this very cell took (None: start at step 0)."""
    for path in sorted(root.glob("step-*"), reverse=True):
        progress = Progress.read(path, 0) if is_complete(path, world) else None
        if progress is not None and progress.cell == json.loads(json.dumps(cell)):  # as the file holds it
            return path
    return None


def source_error(path: Path) -> str | None:
    """Why ``--restore-from PATH`` is no start (None: it is one): it must be a complete save the harness took."""
    if (path / ".metadata").exists() and (path / PROGRESS.format(0)).exists():
        return None
    return (f"--restore-from {path}: not a complete harness checkpoint (no .metadata or {PROGRESS.format(0)}); "
            f"give a step-NNNNNN folder of a run made with --checkpoint sync|async --checkpoint-keep")


def check_same_training(path: Path, cells: list[dict[str, Any]]) -> None:
    """Every cell restored from ``path`` repeats the source's training (:data:`SAME_TRAINING`), or UsageError."""
    source = Progress.read(path, 0)
    if source is None:
        return
    for cell in cells:
        differ = [f"{k} {source.cell.get(k)!r} there, {cell.get(k)!r} here" for k in SAME_TRAINING
                  if source.cell.get(k) != cell.get(k)]
        if cell.get("precision") == "fp16" and source.cell.get("precision") != "fp16":
            differ.append(f"precision {source.cell.get('precision')!r} there, 'fp16' here: an fp16 cell loads the "
                          f"loss scale, which only an fp16 save holds")
        if differ:
            raise UsageError(f"--restore-from {path}: saved by another training than cell {cell_id_of(cell)} "
                             f"({'; '.join(differ)}); restore into cells of the same {', '.join(SAME_TRAINING)}")


def write_curve(root: Path, losses: list[float]) -> None:
    """Rank 0, once the cell is measured: every step's global loss beside the kept saves (``--restore-from``'s
    reference)."""
    write_json_atomic(root / CURVE, {"losses": losses})


def source_curve(path: Path) -> list[float | None]:
    """The global loss at every step of the run that took the save at ``path`` (empty when it kept no curve)."""
    f = path.parent / CURVE
    return json.loads(f.read_text())["losses"] if f.exists() else []


def losses_against(source: list[float | None], losses: list[float | None], offset: int) -> dict[str, Any]:
    """This cell's step ``i`` is the source's step ``offset + i``: the steps both have a loss for, and the largest
    absolute difference."""
    diffs = [abs(a - b) for a, b in zip(losses, source[offset:]) if a is not None and b is not None]
    return {"steps_compared": len(diffs), "loss_max_abs_diff": max(diffs) if diffs else None}


def last_beat(cell_dir: Path) -> float | None:
    f = cell_dir / LAST_BEAT
    return float(json.loads(f.read_text())["epoch"]) if f.exists() else None


def ended_attempts(progress: Progress, beat: float | None) -> list[dict[str, float | None]]:
    """The attempts before this one, each ended: the one that saved ended at its last measured step (``beat``,
    when it is after the save) or, without a beat, at the save."""
    *before, last = progress.attempts
    ended = beat if beat is not None and beat >= progress.saved_at else progress.saved_at
    return [*before, {**last, "ended_at": ended}]


def resume_metrics(progress: Progress, attempts: list[dict[str, float | None]], started_at: float,
                   resumed_at: float, window_end: float, times: list[float]) -> dict[str, Any]:
    """What the restart cost, from this rank's view: ``attempts`` the ended ones (:func:`ended_attempts`), this
    one started at ``started_at`` (its process), ran its first resumed step at ``resumed_at`` and closed its
    measured window at ``window_end``; ``times`` every step's time in the curve (the earlier attempts' first).

    Goodput is productive step time (each step of the curve once) over the wall time of every attempt, the lost
    work after the save and the restart included."""
    previous = attempts[-1]
    wall = sum(float(a["ended_at"] or 0.0) - float(a["started_at"] or 0.0) for a in attempts) + window_end - started_at
    productive = sum(times)
    return {"from_step": progress.step, "attempt": len(attempts) + 1,
            "lost_s": max(0.0, float(previous["ended_at"] or 0.0) - progress.saved_at),
            "restart_s": resumed_at - started_at, "productive_s": productive, "wall_s": wall,
            "goodput": productive / wall if wall > 0 else None}


@dataclass
class Start:
    """Where this rank's cell starts (:func:`find_start`)."""

    kind: str = "fresh"
    """``fresh`` (step 0), ``resume`` (its own save) or ``restore`` (another run's, ``--restore-from``)."""
    path: Path | None = None
    """The save to load."""
    progress: Progress | None = None
    """resume: this rank's :class:`Progress` at the save; restore: the source's rank 0's."""
    attempts: list[dict[str, float | None]] = field(default_factory=list)
    """The earlier attempts, ended (:func:`ended_attempts`)."""
    started_at: float = 0.0
    """This attempt's process start, seconds since the epoch."""
    loaded: dict[str, float] = field(default_factory=dict)
    """The load's seconds and this rank's bytes read."""

    @property
    def first_step(self) -> int:
        """The cell's first step to run: after the save when it resumes its own curve."""
        return self.progress.step + 1 if self.kind == "resume" and self.progress else 0

    @property
    def offset(self) -> int:
        """The training step of the cell's step 0: after the source's save when restored from another run."""
        return self.progress.step + 1 if self.kind == "restore" and self.progress else 0

    def attempts_now(self) -> list[dict[str, float | None]]:
        """The attempts a save made now records: the earlier ones and this one, running."""
        return [*self.attempts, {"started_at": self.started_at, "ended_at": None}]


def find_start(cell: dict[str, Any], cell_dir: Path, world: int, rank: int, started_at: float) -> Start:
    """The cell's own newest complete save (an earlier attempt's), else ``restore_from``'s, else step 0. A cell that
    finished before (its curve kept beside its saves) starts again at step 0."""
    root = cell_dir / "checkpoints"
    own = own_checkpoint(root, cell, world) if not (root / CURVE).exists() else None
    if own is not None:
        progress = Progress.read(own, rank)
        assert progress is not None  # a complete save has every rank's
        return Start("resume", own, progress, ended_attempts(progress, last_beat(cell_dir)), started_at)
    if cell.get("restore_from"):
        path = Path(cell["restore_from"])
        return Start("restore", path, Progress.read(path, 0), started_at=started_at)
    return Start(started_at=started_at)


def start_metrics(start: Start, times: list[float], resumed_at: float, window_end: float) -> dict[str, Any]:
    """This rank's account of its start (``checkpoint.start`` in its log): the load, and for a resume what the
    restart cost (a restore's losses are held against the source's on rank 0: :func:`against_source`)."""
    out: dict[str, Any] = {"kind": start.kind, **start.loaded}
    if start.progress is not None:
        out["from_step"] = start.progress.step
    if start.kind == "resume" and start.progress is not None:
        out.update(resume_metrics(start.progress, start.attempts, start.started_at, resumed_at, window_end, times))
    elif start.kind == "restore":
        out["source"] = str(start.path)
    return out


def against_source(start: Start, losses: list[float]) -> dict[str, Any]:
    """A restored cell's global losses (its step ``i`` is the source's ``offset + i``) against the source's curve."""
    assert start.path is not None
    return losses_against(source_curve(start.path), list(losses), start.offset)
