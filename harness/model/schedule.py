"""The order of a pipeline rank's forwards and backwards, as torch's schedules run them: what FSDP's gathers
and the memory of a pipeline stage follow (:mod:`harness.model.comm`)."""

from __future__ import annotations

from harness.model.inventory import stages_of_rank


def stage_actions(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int) -> dict[int, list[str]]:
    """The order of forwards (``F``) and backwards (``B``) each stage of a pipeline rank runs.

    Mirrors ``torch.distributed.pipelining``: GPipe runs all forwards, then all backwards;
    1F1B (``Schedule1F1B``) warms up with ``min(m, stages - s)`` forwards, then alternates;
    interleaved 1F1B (``ScheduleInterleaved1F1B``) warms up with
    ``(v - 1) * rounds_size + 2 * (pp - 1 - rank)`` operations, then alternates forward and
    backward across the rank's stages in rounds of ``m / rounds`` microbatches.
    """
    m = microbatches
    stages = stages_of_rank(pp_rank, pp, virtual)
    if schedule == "gpipe":
        return {s: ["F"] * m + ["B"] * m for s in stages}
    if schedule == "1f1b":
        s = stages[0]
        warm = min(m, pp - s)
        seq = ["F"] * warm
        f, b = warm, 0
        while b < m:
            seq.append("B")
            b += 1
            if f < m:
                seq.append("F")
                f += 1
        return {s: seq}
    rounds = max(1, m // pp)
    per_round = m // rounds
    total = virtual * m
    warm = min((virtual - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    out: dict[int, list[str]] = {s: [] for s in stages}

    def fwd_stage(op: int) -> int:
        return stages[(op // per_round) % virtual]

    def bwd_stage(op: int) -> int:
        return stages[virtual - 1 - ((op - warm) // per_round) % virtual]

    for op in range(total + warm):  # warmup F, then (F, B) pairs, then cooldown B
        if op < warm:
            out[fwd_stage(op)].append("F")
            continue
        if op < total:
            out[fwd_stage(op)].append("F")
        out[bwd_stage(op)].append("B")
    return out


def gathers(actions: list[str], reshard_after_forward: bool) -> int:
    """All-gathers one FSDP group needs over a stage's actions.

    A group starts sharded; an action on a sharded group gathers it. After a forward it is
    resharded when ``reshard_after_forward``; after a pipeline backward it stays gathered.
    """
    n, sharded = 0, True
    for a in actions:
        if sharded:
            n += 1
            sharded = False
        if a == "F" and reshard_after_forward:
            sharded = True
    return n
