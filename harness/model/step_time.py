"""Predicted step time = compute + exposed communication + pipeline bubble (+ optimizer).

* compute: :mod:`harness.model.compute` per pass, times the passes a rank runs (accumulation
  micro-steps, or pipeline microbatches on the slowest stage), divided by the rank's share of
  the cores when CPU ranks oversubscribe them;
* communication: each call of :mod:`harness.model.comm` at the calibrated time for its
  collective, message size and group size (:func:`harness.model.comm_fit.fitted_time_s`,
  nccl-tests busbw), or at ``latency + S * factor / busbw`` from an interconnect table for
  what-if. What the strategy can overlap (DDP buckets, FSDP prefetch, async sends) is hidden
  behind compute up to the compute time, except the first and the last such call (the first
  FSDP all-gather precedes all compute, the last DDP bucket / reduce-scatter follows it) on GPUs; on CPU ranks nothing is hidden (gloo reduces on the same cores that compute);
* interference (GPU what-ifs): a collective's kernels take SMs and memory bandwidth from the compute they run
  beside, so the compute that hides a collective runs ``1 + overlap_slowdown`` times as long
  (:data:`OVERLAP_SLOWDOWN`): ``overlap_slowdown x min(hidden comm, compute)`` is added;
* expert load: under expert parallel the experts' share of the compute (:func:`expert_flop_share`) is
  scaled by the busiest expert's load over the mean (``CellShape.moe_imbalance``), the rank holding it
  being the one every other waits for at the combine (an upper bound when a rank holds several experts);
* pipeline bubble: ``(p - 1) / (v * m)`` of the slowest stage's compute for GPipe, 1F1B and interleaved 1F1B,
  and the bubble simulated from its action list for any schedule (:mod:`harness.model.pipeline_sim`) (Narayanan et al.
  2021, section 2.2.1 and eq. for interleaving); CPU stages that share cores are priced slot by
  slot (:func:`harness.model.compute.pipeline_time_s`): a slot with fewer stages busy runs
  faster, so an oversubscribed node fills part of the bubble.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.model import comm as comm_model
from harness.model.compute import (
    NO_SHARING,
    ComputeRates,
    CoreSharing,
    expert_flop_share,
    pass_time_s,
    pipeline_time_s,
    stage_shares,
)
from harness.model.inventory import coords
from harness.model.memory import state_bytes_by_rank
from harness.model.pipeline_sim import schedule_bubble
from harness.model.shape import CellShape
from harness.parallel.schedules import expected_bubble

OVERLAP_SLOWDOWN = 0.189
"""How much longer compute runs while a collective runs beside it, on GPUs: Lee et al. 2025, "Characterizing
Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and Power Implications"
(arXiv 2507.03114): "an average computational slowdown of 18.9%, with a maximum of 40.0%", GPT and Llama models on
A100, H100, MI250 and MI210, against the same compute with no communication beside it."""

CommTime = Callable[[str, int, int, str], float | None]
"""(collective, nbytes, group size, mesh dim) -> seconds per call, or None when not calibrated."""


@dataclass(frozen=True)
class StepPrediction:
    step_time_s: float | None
    compute_s: float
    optimizer_s: float
    comm_s: float | None
    exposed_comm_s: float | None
    bubble_s: float
    bubble_fraction: float
    basis: str
    notes: tuple[str, ...] = ()
    interference_s: float = 0.0
    """What the collectives hidden behind compute slow it by (:data:`OVERLAP_SLOWDOWN`; 0 but in GPU what-ifs)."""

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s, "optimizer_s": self.optimizer_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s, "bubble_s": self.bubble_s,
                "bubble_fraction": self.bubble_fraction, "basis": self.basis}


def _p2p_name(collective: str) -> str:
    return "send_recv" if collective in ("send", "recv") else collective


def _known_s(p: StepPrediction) -> float:
    """A rank's step time, or where a collective is not calibrated what is known of it (compute, optimizer, bubble):
    the slowest rank is reported either way."""
    return p.step_time_s if p.step_time_s is not None else p.compute_s + p.optimizer_s + p.bubble_s


def predict_step(c: CellShape, rates: ComputeRates, comm_time: CommTime, sharing: CoreSharing = NO_SHARING,
                 hide_overlappable: bool = True, overlap_slowdown: float = 0.0) -> StepPrediction:
    """The slowest rank's predicted step time (ranks wait for each other at every collective); ``overlap_slowdown``:
    what hidden collectives slow the compute beside them by (the module docstring)."""
    dims = c.dims
    all_busy = sharing.factor(sharing.node_ranks)  # data and tensor parallel ranks compute at once
    shares = stage_shares(c)
    states = state_bytes_by_rank(c)
    ranks = coords(dims)
    v = c.virtual
    bubble_frac = schedule_bubble(c.pp_schedule, dims.pp, c.microbatches) if dims.pp_enabled else 0.0
    passes = c.microbatches if dims.pp_enabled else c.grad_accum
    notes: list[str] = []
    best = None
    for k in ranks:
        if k.dp_replicate or k.dp_shard or k.tp:  # ranks of one pipeline rank are alike; price one each
            continue
        flop_share, layer_share = shares[k.pp]
        if rates.stage_pass_s is not None:
            one_pass = rates.stage_pass_s[k.pp]
        else:
            one_pass = pass_time_s(rates, c.microbatch_rows, flop_share, layer_share, dims.tp * dims.cp)
        compute = passes * one_pass * all_busy
        if dims.ep_enabled and c.moe_imbalance > 1:  # the rank with the busiest experts sets the pace
            compute *= 1 + (c.moe_imbalance - 1) * expert_flop_share(c)
        optimizer = (rates.optimizer_s_per_param * states[k.rank].params / 4
                     + rates.wrapper_optimizer_s * layer_share) * all_busy
        calls = comm_model.rank_calls(c, k)
        total = hidden_ok = 0.0
        exposed = 0.0
        missing = set()
        edge: list[float] = []  # the first and last overlappable calls: nothing to hide them behind
        for call in calls:
            t = comm_time(_p2p_name(call.collective), call.nbytes, call.group, call.dim)
            if t is None:
                missing.add((call.collective, call.group))
                continue
            total += t
            if call.collective == "send":  # isend: never waited for on the critical path
                continue
            if call.overlappable and hide_overlappable:
                hidden_ok += t
                edge = [edge[0], t] if edge else [t]
            else:
                exposed += t
        interference = 0.0
        if hide_overlappable and hidden_ok:
            left_out = max(sum(edge), hidden_ok - compute)
            exposed += left_out
            interference = overlap_slowdown * min(hidden_ok - left_out, compute)
        bubble = 0.0
        if dims.pp_enabled:  # max(0, ...): only float rounding can make the schedule shorter than its work
            # the slot model's bubble is (p - 1) / (v m) of the compute, cores shared as the slots fill; a schedule
            # whose simulated bubble differs (zero-bubble: W fills it) scales it by simulated over formula (1 for
            # gpipe, 1f1b and interleaved1f1b, whose simulation equals the formula)
            bubble = max(0.0, pipeline_time_s(one_pass, dims.pp, v, c.microbatches, max(1, sharing.node_ranks // dims.pp),
                                              sharing) - compute) * bubble_frac / expected_bubble(dims.pp, v, c.microbatches)
        comm_known = not missing
        step = compute + optimizer + exposed + bubble + interference
        if missing:
            notes.append("no comm calibration for " + ", ".join(f"{c_} over {g} ranks" for c_, g in sorted(missing))
                         + "; run harness calibrate --gpus N")
        cand = StepPrediction(step_time_s=step if comm_known else None, compute_s=compute, optimizer_s=optimizer,
                              comm_s=total if comm_known else None, exposed_comm_s=exposed if comm_known else None,
                              bubble_s=bubble, bubble_fraction=bubble_frac, basis=rates.basis, notes=tuple(notes),
                              interference_s=interference if comm_known else 0.0)
        if best is None or _known_s(cand) > _known_s(best):
            best = cand
    assert best is not None
    return best
