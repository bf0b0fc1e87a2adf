"""Pipeline schedules: their names, how many stages a rank holds and where, what each needs, and the
textbook bubble. :mod:`harness.parallel.pipeline` builds them; :mod:`harness.model.pipeline_sim` plays
their action lists out."""

from __future__ import annotations

from harness.errors import UsageError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zb", "zbv", "dualpipev")
ZERO_BUBBLE_SCHEDULES = ("zb", "zbv", "dualpipev")
"""Schedules that split each backward into its input-gradient (I) and weight-gradient (W) parts and fill the
bubble with W (Qi et al. 2023): ``zb`` is torch's ``ScheduleInterleavedZeroBubble``, two looped stages per rank;
``zbv`` (``ScheduleZBVZeroBubble``) and ``dualpipev`` (``ScheduleDualPipeV``, DeepSeek-V3's, which also overlaps a
forward with a backward) hold two stages per rank in a V: rank r the stages r and 2 pp - 1 - r."""
V_SCHEDULES = ("zbv", "dualpipev")
STAGE_ACTIONS = ("forward", "backward", "backward_input", "backward_weight", "reduce_grad", "p2p_wait")
"""What a pipeline rank's step time splits into (:mod:`harness.parallel.pipeline_clock` times them), besides
``other``: a whole backward, or under a zero-bubble schedule its input-gradient (I) and weight-gradient (W) parts;
the gradient reduce after the last microbatch; and the waits on sends and receives (the bubble, on a rank that
has the CPU to itself)."""


def stage_action_split_ms(laps: list[dict[str, float]], step_times: list[float]) -> dict[str, float] | None:
    """The mean of the measured steps' splits (``laps``: seconds per action, one per step), in ms, and ``other``:
    the mean step time less the actions' (the schedule's bookkeeping, posting transfers). None without laps."""
    if not laps or len(laps) != len(step_times):
        return None
    n = len(laps)
    out = {a: 1e3 * sum(lap.get(a, 0.0) for lap in laps) / n for a in STAGE_ACTIONS}
    out["other"] = 1e3 * sum(step_times) / n - sum(out.values())
    return out


def stages_per_rank(pp_schedule: str) -> int:
    """Virtual stages per rank: 2 for interleaved 1F1B (Narayanan et al. 2021) and interleaved zero-bubble,
    else 1."""
    if pp_schedule not in PP_SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {pp_schedule!r}; choose from {', '.join(PP_SCHEDULES)}")
    return 2 if pp_schedule in ("interleaved1f1b", "zb", *V_SCHEDULES) else 1


def check_schedule_compile(pp_schedules: tuple[str, ...], compiles: tuple[bool, ...]) -> None:
    """torch 2.13's zero-bubble schedules refuse stage modules that were torch.compile'd (their backward is split
    into input and weight parts by autograd; ``_check_torch_compile_compatibility`` raises)."""
    zb = [s for s in pp_schedules if s in ZERO_BUBBLE_SCHEDULES]
    if zb and any(compiles):
        raise UsageError(f"--pp-schedule {','.join(zb)} with --compile on: torch's zero-bubble schedules split each "
                         f"backward by autograd and refuse compiled stages (torch.distributed.pipelining."
                         f"schedules._check_torch_compile_compatibility); use --compile off, or --pp-schedule "
                         f"1f1b or interleaved1f1b")


def check_schedule_ac(pp_schedules: tuple[str, ...], policies: tuple[str, ...], flag: str = "--ac") -> None:
    """torch's zero-bubble schedules split each backward into an input pass and a weight pass, and torch's selective
    activation checkpointing (the ``op`` policy) allows one backward through a region: the second pass raises
    "Trying to backward an extra time" (measured: pp at 2 ranks under zb, zbv and dualpipev, each crashed)."""
    zb = [s for s in pp_schedules if s in ZERO_BUBBLE_SCHEDULES]
    if zb and "op" in policies:
        raise UsageError(f"--pp-schedule {','.join(zb)} with {flag} op: torch's zero-bubble schedules run each "
                         f"backward twice (input, then weight) and its selective checkpointing allows one "
                         f"(\"Trying to backward an extra time\"); use {flag} full, layerN or attn, or --pp-schedule "
                         f"1f1b or interleaved1f1b")


def min_microbatches(pp_schedule: str, pp: int) -> int:
    """1F1B-style schedules need at least one microbatch in flight per rank; the V schedules one per stage
    (torch's ``ScheduleDualPipeV`` checks it; ZBV's order assumes it)."""
    if pp_schedule == "gpipe":
        return 1
    return 2 * pp if pp_schedule in V_SCHEDULES else pp


def expected_bubble(pp: int, virtual: int, microbatches: int) -> float:
    """Pipeline bubble fraction ``(p - 1) / (v * m)`` (Narayanan et al. 2021, eq. for interleaving)."""
    return (pp - 1) / (virtual * microbatches)


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Split layers as evenly as possible; earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def placement(pp_rank: int, pp: int, virtual: int, v_shape: bool = False) -> list[int]:
    """Stage indices a pipeline rank holds: looped (``r, r + pp, ...``, one per virtual stage) or, for the V
    schedules, ``r`` and ``2 pp - 1 - r`` (the first rank holds the first and the last stage)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """Stage indices a rank holds under ``schedule`` (:func:`placement`)."""
    return placement(pp_rank, pp, stages_per_rank(schedule), schedule in V_SCHEDULES)


def check_pipeline(pp: int, n_layers: int, pp_schedule: str, microbatches: int) -> None:
    """A pipeline of ``pp`` ranks under ``pp_schedule`` on ``n_layers`` layers: enough layers for its stages, enough
    microbatches, and the rounds torch's looped schedules run them in."""
    stages = pp * stages_per_rank(pp_schedule)
    if stages > n_layers:
        raise UsageError(
            f"pipeline stages ({stages} = pp {pp} x {stages_per_rank(pp_schedule)} per rank) exceed "
            f"layers ({n_layers}); lower pp or use a deeper size"
        )
    need = min_microbatches(pp_schedule, pp)
    if microbatches < need:
        raise UsageError(
            f"schedule {pp_schedule} with pp {pp} needs >= {need} microbatches, got {microbatches}; "
            f"raise --microbatches"
        )
    if pp_schedule in ("interleaved1f1b", "zb") and microbatches % pp:  # torch's rounds of pp microbatches
        raise UsageError(
            f"schedule {pp_schedule} needs microbatches ({microbatches}) divisible by pp ({pp}); "
            f"use a multiple of {pp}"
        )


def check_schedule_layout(strategy: str, pp_schedule: str, fsdp: bool) -> None:
    """The zero-bubble schedules under FSDP are refused: zb measured wrong, the V ones not checked."""
    if pp_schedule not in ZERO_BUBBLE_SCHEDULES or not fsdp:
        return
    why = ("does not train as one device does on torch 2.13 (measured: pp+fsdp at 4 ranks, parameters off after "
           "one step)" if pp_schedule == "zb" else "is not checked here: the zb schedule's split backward under "
           "FSDP did not train as one device does, and the model does not count a V's FSDP gathers")
    raise UsageError(f"{strategy} with --pp-schedule {pp_schedule}: under FSDP the zero-bubble schedule {why}; "
                     f"use --strategies pp, or --pp-schedule 1f1b or interleaved1f1b")
