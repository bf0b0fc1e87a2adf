"""A pipeline schedule's bubble, played out from its own action list: one simulation for every schedule.

The action list of a multi-stage schedule is torch's own (``pipeline_order`` of
``torch.distributed.pipelining.schedules``: each rank's forwards ``F``, input-gradient backwards ``I``,
weight-gradient backwards ``W``, whole backwards ``B`` per stage and microbatch), built from stand-in stages,
so a schedule torch adds is predicted without a formula of its own. GPipe and 1F1B run one stage per rank and
build no such list in torch; theirs is :func:`harness.model.schedule.stage_actions`. DualPipeV's overlapped
forward-and-backward pairs (``OVERLAP_F_B``) run one after the other here: on one device the two share its
compute, and what the overlap hides (transfers, an MoE's all-to-all) is not in this count.

Each rank runs its actions in order; an action starts when the rank is free and what it needs is done: a
forward the previous stage's forward of that microbatch, a backward (``I`` or ``B``) the next stage's backward
and its own forward, ``W`` its ``I``. The bubble of a rank is its idle time over the step (the last action
anywhere ends it) divided by its busy time: ``(p - 1) / (v m)`` for GPipe, 1F1B and interleaved 1F1B with
equal stages and free transfers (Narayanan et al. 2021), less for zero-bubble schedules, which fill it with W.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache

from harness.errors import UsageError
from harness.model.schedule import stage_actions
from harness.parallel.schedules import stage_ids, stages_per_rank

Action = tuple[str, int, int]
"""(kind, stage, microbatch): kind F, I (input gradient), W (weight gradient) or B (both)."""


@dataclass(frozen=True)
class ActionTimes:
    """Seconds of one stage's forward, input-gradient and weight-gradient backward for one microbatch."""

    f: float = 1.0
    i: float = 1.0
    w: float = 1.0

    def of(self, kind: str) -> float:
        return {"F": self.f, "I": self.i, "W": self.w, "B": self.i + self.w}[kind]


@dataclass(frozen=True)
class RankBubble:
    """One pipeline rank's time over a simulated step: computing, and waiting until the step's last action ends."""

    busy: float
    idle: float

    @property
    def fraction(self) -> float:
        """Idle over busy: the share of the ideal step a rank waits (0 = no bubble)."""
        return self.idle / self.busy if self.busy else 0.0


class _Stage:
    """What torch's schedule constructors read of a stage, without a process group or a module."""

    def __init__(self, index: int, n_stages: int, rank: int, pp: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, n_stages, rank, pp
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


_KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
_TORCH_CLASSES = {"interleaved1f1b": "ScheduleInterleaved1F1B", "zb": "ScheduleInterleavedZeroBubble",
                  "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


@lru_cache(maxsize=128)
def schedule_order(schedule: str, pp: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """Each pipeline rank's actions in the order torch runs them (cached: read it, do not change it)."""
    if schedule not in _TORCH_CLASSES:  # one stage per rank: GPipe or 1F1B, microbatches in order per kind
        out: dict[int, tuple[Action, ...]] = {}
        for rank in range(pp):
            (stage, kinds), = stage_actions(schedule, pp, 1, microbatches, rank).items()
            seen = {"F": 0, "B": 0}
            actions = []
            for k in kinds:
                actions.append((k, stage, seen[k]))
                seen[k] += 1
            out[rank] = tuple(actions)
        return out
    from torch.distributed.pipelining import schedules  # noqa: PLC0415 (0.8 s; only a multi-stage schedule needs it)

    cls = getattr(schedules, _TORCH_CLASSES[schedule])
    n_stages = pp * stages_per_rank(schedule)
    stages = [_Stage(s, n_stages, 0, pp) for s in stage_ids(0, pp, schedule)]
    order = cls(stages, n_microbatches=microbatches, loss_fn=lambda out, target: out).pipeline_order
    return {rank: tuple((_KINDS[b.computation_type.name], b.stage_index, b.microbatch_index)
                        for a in actions if a is not None for b in (a.sub_actions or (a,)))
            for rank, actions in order.items()}


def simulate(schedule: str, pp: int, microbatches: int, times: ActionTimes = ActionTimes()) -> list[RankBubble]:
    """Play each rank's actions out with ``times`` per stage and free transfers; each rank's busy and idle time."""
    order = schedule_order(schedule, pp, microbatches)
    n_stages = pp * stages_per_rank(schedule)
    done: dict[tuple[str, int, int], float] = {}
    clock, nxt, busy = [0.0] * pp, [0] * pp, [0.0] * pp

    def ready(kind: str, s: int, m: int) -> float | None:
        if kind == "F":
            needs = [("F", s - 1, m)] if s > 0 else []
        elif kind == "W":
            needs = [("I", s, m)]
        else:
            needs = [("F", s, m)] + ([] if s == n_stages - 1 else [("I", s + 1, m)])
        if any(n not in done for n in needs):
            return None
        return max([done[n] for n in needs], default=0.0)

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r in range(pp):
            if nxt[r] == len(order[r]):
                continue
            kind, s, m = order[r][nxt[r]]
            at = ready(kind, s, m)
            if at is None:
                continue
            end = max(clock[r], at) + times.of(kind)
            done[(kind, s, m)] = end
            if kind == "B":  # a whole backward is also its input-gradient part, for the stage before
                done[("I", s, m)] = end
            clock[r], busy[r] = end, busy[r] + times.of(kind)
            nxt[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise UsageError(f"schedule {schedule} at pp {pp}, {microbatches} microbatches: its actions wait on each "
                             f"other (no rank can start its next one)")
    step = max(clock)
    return [RankBubble(busy[r], step - busy[r]) for r in range(pp)]


@lru_cache(maxsize=256)
def schedule_bubble(schedule: str, pp: int, microbatches: int) -> float:
    """The largest rank's bubble (idle over busy) with F, I and W of equal time: a backward twice a forward,
    half of it the weights' gradients (each linear's two backward matmuls). GPipe, 1F1B and interleaved 1F1B
    come out at their formula ``(p - 1) / (v m)`` whatever the ratio; zero-bubble schedules lower."""
    return max(b.fraction for b in simulate(schedule, pp, microbatches))


def live_peak(order: tuple[Action, ...], keeps: Mapping[int, float], held_for_w: Mapping[int, float]) -> float:
    """The most bytes a rank's in-flight microbatches hold at once, played out from its own action order.

    A forward of stage ``s`` keeps ``keeps[s]`` (what the stage saves for its backward, one microbatch) until that
    microbatch's whole backward (B) or, when the backward is split, its weight-gradient part (W): torch's
    ``stage_backward_input`` computes the input gradient with ``retain_graph=True`` and keeps the graph for the W
    that follows, and its I adds ``held_for_w[s]`` (the gradients at the weights' outputs, which W starts from) until
    then. Memory follows the order alone, not the times: 1F1B's rank r holds ``pp - r`` microbatches, GPipe's all;
    a zero-bubble schedule holds each microbatch until its W, later than its I.
    """
    return max((live for _, live in _played(order, keeps, held_for_w)), default=0.0)


def weight_pass_peak(order: tuple[Action, ...], keeps: Mapping[int, float], held_for_w: Mapping[int, float],
                     weight_pass: Mapping[int, float]) -> float:
    """The most bytes a rank holds during one of its weight-gradient steps: what :func:`live_peak` plays out as held
    just before that W, and what the W itself holds above it (``weight_pass[s]``,
    :mod:`harness.model.split_memory`)."""
    return max((live + weight_pass.get(s, 0.0) for (kind, s, _), live in _played(order, keeps, held_for_w)
                if kind == "W"), default=0.0)


def _played(order: tuple[Action, ...], keeps: Mapping[int, float],
            held_for_w: Mapping[int, float]) -> Iterator[tuple[Action, float]]:
    """Each action with the bytes held just after it (a W's: just before, the moment its own pass runs)."""
    live = 0.0
    for action in order:
        kind, s, _ = action
        if kind == "F":
            live += keeps[s]
        elif kind == "I":
            live += held_for_w[s]
        elif kind == "W":
            yield action, live
            live -= keeps[s] + held_for_w[s]
            continue
        else:
            live -= keeps[s]
        yield action, live
