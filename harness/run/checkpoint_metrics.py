"""A cell's ``metrics.checkpoint`` from what each rank's :class:`harness.run.checkpoint.Checkpointer` logged
(pure: the record builder imports no checkpoint machinery)."""

from __future__ import annotations

import statistics
from typing import Any


def checkpoint_metrics(logs: list[dict[str, Any]], step_median_s: float, states_by_rank: list[int],
                       replicas: int = 1) -> dict[str, Any]:
    """The cell's ``metrics.checkpoint`` from every rank's :class:`harness.run.checkpoint.CheckpointLog` (rank order):
    per save the slowest rank's blocking seconds, their median and the cost per step at the interval; bytes per rank
    against what a checkpoint holds (``states_by_rank``: parameters and optimizer state, gradients not saved; DCP
    writes a tensor ``replicas`` ranks hold once, so the sum is held against one replica's); the write rate; the
    restore check."""
    saves = [log["saves"] for log in logs]
    n = min(len(s) for s in saves)
    blocking = [max(s[i]["blocking_s"] for s in saves) for i in range(n)]
    background = [max(s[i]["background_s"] for s in saves) for i in range(n) if all(s[i]["background_s"] for s in saves)]
    written = [statistics.median(x["bytes_written"] for x in s) if s else 0 for s in saves]
    median_block = statistics.median(blocking) if blocking else None
    write_s = statistics.median(background) if background else median_block
    restores = [log["restore"] for log in logs if log.get("restore")]
    starts = [log["start"] for log in logs if log.get("start")]
    if n == 0:  # a cell restored from another run's save that takes none of its own
        return {"mode": logs[0]["mode"], "every": logs[0]["every"], "saves": 0,
                "start": start_summary(starts) if starts else None}
    return {
        "mode": logs[0]["mode"], "every": logs[0]["every"], "saves": n,
        "blocking_s": blocking, "blocking_s_median": median_block,
        "background_s_median": statistics.median(background) if background else None,
        "cost_per_step_pct": 100 * median_block / logs[0]["every"] / step_median_s
        if median_block is not None and step_median_s > 0 else None,
        "bytes_written_by_rank": written,
        "state_bytes_by_rank": states_by_rank,
        "written_over_states": sum(written) * replicas / sum(states_by_rank) if sum(states_by_rank) else None,
        "write_gib_per_s": sum(written) / write_s / 2**30 if write_s else None,
        "restore": _restore_summary(restores) if restores else None,
        "start": start_summary(starts) if starts else None,
    }


def _restore_summary(restores: list[dict[str, Any]]) -> dict[str, Any]:
    diffs = [r["loss_max_abs_diff"] for r in restores if r.get("loss_max_abs_diff") is not None]
    return {"from_step": restores[0]["from_step"], "steps_replayed": restores[0]["steps_replayed"],
            "load_s": max(r["load_s"] for r in restores), "bytes_read_by_rank": [r["bytes_read"] for r in restores],
            "loss_max_abs_diff": max(diffs) if diffs else None}


def start_summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the cell started, from every rank's account (:func:`harness.run.resume.start_metrics`): the slowest
    load; a resume's restart cost as the rank with the lowest goodput saw it; a restore's source (its losses against
    the source's are rank 0's to add: :func:`harness.run.resume.against_source`)."""
    out: dict[str, Any] = {"kind": starts[0]["kind"], "from_step": starts[0].get("from_step")}
    if "load_s" in starts[0]:
        out["load_s"] = max(s["load_s"] for s in starts)
    if "bytes_read" in starts[0]:
        out["bytes_read_by_rank"] = [s["bytes_read"] for s in starts]
    if "source_bytes" in starts[0]:
        out["source_bytes"] = starts[0]["source_bytes"]
    if out["kind"] == "resume":
        worst = min(starts, key=lambda s: s["goodput"] if s["goodput"] is not None else float("inf"))
        out.update({k: worst[k] for k in ("attempt", "lost_s", "restart_s", "productive_s", "wall_s", "goodput")})
    elif out["kind"] == "restore":
        out["source"] = starts[0]["source"]
    return out
