"""Parity with one device: which cells must match (:func:`parity_key`), by how much (:data:`PARITY_TOL`), and
the record's ``parity`` from a cell's metrics and its reference record (:func:`parity_metrics`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from harness.records.record import pulled_levers
from harness.records.schema import RunMetrics
from harness.run.formulas import max_rel_diff


@dataclass(frozen=True)
class ParityTolerance:
    """Largest relative difference from the single-device reference that still counts as parity.

    ``grad_norm``: the global gradient norm after step 1's backward. Different reduction orders
    (all-reduce, sharded matmuls, microbatch sums) change fp32 results by a few ulps per op,
    <= 1e-8 relative here; 1e-6 leaves two orders of margin, and a wrong gradient scale is off
    by O(1) (x2 for a sum instead of a mean). ``params``: each parameter tensor's norm after step
    1's update, over the tensors that have a gradient (a tensor left out of the update, or
    updated from the wrong gradient, moves by ~1e-2 of its norm; reduction-order noise stays
    ~1e-6, where an element's gradient is near Adam's eps). ``loss``: the loss curve over every
    step; AdamW's normalised update carries the ulps into the loss at ~1e-6 over tens of steps,
    but cannot see a gradient scale, hence the two step-1 checks. Low-precision modes round
    every matmul to 8 (bf16) or 11 (fp16) mantissa bits (10 for tf32 on GPUs), so their numbers
    agree to ~1e-2 only: still far from the x2 of a scale bug.
    """

    loss: float
    grad_norm: float
    params: float


PARITY_TOL = {
    "fp32": ParityTolerance(loss=1e-4, grad_norm=1e-6, params=1e-5),
    "tf32": ParityTolerance(loss=5e-3, grad_norm=5e-3, params=2e-2),
    "bf16": ParityTolerance(loss=2e-2, grad_norm=5e-3, params=2e-2),
    "fp16": ParityTolerance(loss=2e-2, grad_norm=5e-3, params=2e-2),
    "fp8": ParityTolerance(loss=2e-2, grad_norm=3e-2, params=3e-2),
}
"""Measured on tiny, CPU, 2 ranks, against these (tests/distributed/test_parity.py holds its own
copies): fp32 gradient norm <= 1e-8 and parameter norms <= 1.1e-6 (ddp, fsdp, tp, tp-sp, pp,
ddp with grad_accum 2); bf16 <= 2.2e-4 and <= 3.9e-3. fp8 is held to the bf16 single device (its float8
casts round to e4m3's 3-bit mantissa, up to 2^-4 of each element, in every converted matmul): measured with
torchao's emulation on CPU (results/reference/fp8-emulated-cpu-tiny-w2-w4) as in that run's README; a scale 4x
too large (values saturating) is off by more (tests/distributed/test_parity_fp8.py)."""


def parity_key(cfg: dict) -> tuple:
    """Cells whose loss curves must match: same work (an MoE's routing included), same data, same schedule of LRs
    (the levers change none of them: a compiled or checkpointed cell must match the eager one). An fp8 cell is held
    to bf16's curve (its matmuls are bf16's with float8 rounding: :data:`PARITY_TOL`)."""
    precision = "bf16" if cfg.get("precision") == "fp8" else cfg.get("precision")
    # an MoE's routing is its own work: learned and balanced cells each have their reference (also on a resume, which
    # re-reads both singles)
    return (cfg.get("arch", "gpt2"), cfg.get("size"), precision, cfg.get("moe_routing", "learned")) + tuple(
        cfg.get(k) for k in ("global_batch", "seq_len", "lr", "lr_warmup_steps", "seed", "steps", "warmup", "scaling",
                             "lr_rule"))


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


DEAD_GRAD_FRACTION = 1e-6
"""A tensor whose step-1 gradient norm is below this fraction of the global one has no gradient in
exact arithmetic (the attention key bias: softmax ignores a shift shared by all keys); Adam turns
its rounding noise into an update of any sign, so its norm says nothing about parity."""


def _live_tensors(grad_norms: dict[str, float | None], total: float | None) -> set[str]:
    if not total:
        return set()
    return {k for k, g in grad_norms.items() if g is not None and g >= DEAD_GRAD_FRACTION * total}


def _beyond_noise(diff: float | None, near_eps: float) -> float | None:
    """A tensor's step-1 norm difference less what its gradient elements near Adam's eps can move it by: each such
    element's update is rounding noise of at most ``lr`` in size (``g / (|g| + eps)`` in ``[0, 1]``), and the norm of a
    tensor's first update is ``lr`` per element, so a share ``f`` of them moves its norm by less than ``f / 2``
    relative (:data:`harness.measure.parity_probe.NEAR_EPS`). A tensor left out of the update, or updated from
    another gradient, still moves by far more."""
    if diff is None:
        return None
    return max(0.0, diff - near_eps / 2)


ROUTING_FLIP_SLOTS = 2
"""Expert slots (token x choice) each layer of an MoE step may route otherwise than the reference for the
difference to be a near-tie of the top-k flipped by rounding. A token that moved between two experts
moves one slot, and its changed output may move it again in each later layer (the first CPU
reference: one slot in 5 of mini's 6 layers). More in any layer is a routing that differs: parity is
then judged on the whole curve."""


def routing_divergence(samples: dict, ref_samples: dict) -> dict | None:
    """The first step whose expert load differs from the reference's (``samples.moe_load_per_step``), and the
    slots it moved; None when every step routed alike or either side has no loads."""
    mine, theirs = samples.get("moe_load_per_step"), ref_samples.get("moe_load_per_step")
    if not mine or not theirs:
        return None
    for step, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            per_layer = [sum(abs(x - y) for x, y in zip(ra, rb)) / 2 for ra, rb in zip(a, b)]
            return {"step": step, "slots_moved": sum(per_layer), "max_slots_moved_per_layer": max(per_layer)}
    return None


def parity_diffs(worker: Mapping[str, Any], samples: dict, ref: dict) -> dict[str, float | None]:
    """Relative differences from the reference record: loss curve, step-1 gradient norm, and the
    largest over parameter tensors (those with a gradient) of the step-1 norm difference (None:
    not comparable). An MoE whose routing diverged from the reference's by a rounding flip
    (:func:`routing_divergence`) has its loss curve compared over the steps before the flip."""
    rm, rs = ref["metrics"], ref.get("samples") or {}
    curve, ref_curve = worker.get("loss"), rm.get("loss")
    flip = routing_divergence(samples, rs)
    if curve and ref_curve and flip and flip["max_slots_moved_per_layer"] <= ROUTING_FLIP_SLOTS:
        curve, ref_curve = curve[:flip["step"]], ref_curve[:flip["step"]]
    loss = max_rel_diff(curve, ref_curve) if curve and ref_curve else None
    mine, theirs = samples.get("param_norms_step1"), rs.get("param_norms_step1")
    params = None
    if mine and theirs and set(mine) == set(theirs):
        live = _live_tensors(rs.get("grad_norms_step1") or {}, rm.get("grad_norm_step1"))
        near = rs.get("grad_near_eps_step1") or {}
        diffs = [_beyond_noise(_rel(mine[k], theirs[k]), near.get(k, 0.0)) for k in theirs if k in live]
        known = [d for d in diffs if d is not None]
        params = max(known) if diffs and len(known) == len(diffs) else None
    return {"loss": loss, "grad_norm": _rel(worker.get("grad_norm_step1"), rm.get("grad_norm_step1")),
            "params": params}


_WHAT = {"loss": "loss curve", "grad_norm": "gradient norm after step 1", "params": "parameter norms after step 1"}


def parity_metrics(cell_id: str, cfg: dict, worker: Mapping[str, Any], samples: dict, ref: dict | None) -> RunMetrics:
    """The cell's parity against its single-device reference record (``ref``, None when the run has none)."""
    tol = PARITY_TOL[cfg["precision"]]
    fp8 = cfg["precision"] == "fp8"
    if cfg["strategy"] == "single" and not fp8 and (ref is None or not pulled_levers(cfg)):
        return {"parity_max_rel_diff": 0.0, "parity": {"reference": cell_id, "tolerance": asdict(tol), "ok": True}}
    if ref is None:
        return {"parity_max_rel_diff": None,
                "parity": {"reference": None, "tolerance": asdict(tol), "ok": None,
                           "reason": "n/a: no single-device reference with the same global batch in this run"}}
    diffs = parity_diffs(worker, samples, ref)
    off = [f"{_WHAT[k]} differs by {d:.1e} > {getattr(tol, k):.0e}" for k, d in diffs.items()
           if d is not None and d > getattr(tol, k)]
    if fp8:
        off += _fp8_conversion_off(worker.get("fp8") or {})
    missing = [_WHAT[k] for k, d in diffs.items() if d is None]
    parity = {"reference": ref["cell_id"], "tolerance": asdict(tol), "rel_diff": diffs,
              "ok": not off if diffs["loss"] is not None else None}
    flip = routing_divergence(samples, ref.get("samples") or {})
    if flip is not None:
        parity["routing_diverged"] = {**flip, "loss_compared_steps": flip["step"]
                                      if flip["max_slots_moved_per_layer"] <= ROUTING_FLIP_SLOTS
                                      else len(worker.get("loss") or [])}
    if off:
        parity["reason"] = f"vs {ref['cell_id']}: " + "; ".join(off)
    elif missing:
        parity["reason"] = "not compared: " + ", ".join(missing) + " (absent or not finite on one side)"
    return {"parity_max_rel_diff": diffs["loss"], "parity": parity}


def _fp8_conversion_off(fp8: Mapping[str, Any]) -> list[str]:
    """An fp8 cell whose converted linears are not the model's: a linear left in bf16 or one converted that
    must not be (the LM head) changes what fp8 means, whatever the loss says."""
    off = []
    if fp8.get("not_converted"):
        off.append(f"{len(fp8['not_converted'])} linear(s) of the model left unconverted ({fp8['not_converted'][0]}, ...)")
    if fp8.get("converted_not_in_model"):
        off.append(f"converted beyond the model's fp8 linears: {', '.join(fp8['converted_not_in_model'][:3])}")
    return off
