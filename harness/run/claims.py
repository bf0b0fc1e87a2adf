"""Every claim a record makes, checked against what the run did (``metrics.claims``).

A record says a cell ran with activation checkpointing, a fused optimizer, compile, sequence parallel, an fp8
recipe, a pipeline schedule, checkpoints, a routing. Each such claim is held here to what the ranks counted or
observed (``metrics.observed``, :func:`harness.run.worker._observed`; the comm counter; the pipeline clock; the
checkpoint log; the expert loads), never to the config that made the claim:

* ``ac``: the matmuls the counted step's backward ran beyond twice its forward's (what it recomputed) against what
  the policy recomputes of the matmuls each block's forward ran (:mod:`harness.measure.op_tally`), under a split
  backward times the passes that recompute each block (:mod:`harness.model.split_backward`);
* ``optimizer``: whether torch's fused AdamW kernel was dispatched;
* ``compile``: the frames dynamo compiled in the cell's steps;
* ``layout``: the collectives each rank counted against the model's for the claimed layout (strategy, degrees,
  sequence parallel, loss parallel, float8 all-gather, context and expert parallel, the pipeline's sends):
  :func:`harness.model.comm.comm_by_rank`, exact on every layout the harness runs;
* ``fp8``: the recipe and the float8 all-gather read off the float8 linears' configs;
* ``pp_schedule``: the stage actions the pipeline clock timed (a zero-bubble schedule splits its backward);
* ``checkpoint``: saves logged with bytes written on every rank;
* ``moe_routing``: the experts' loads (balanced routing gives every expert the same rows);
* ``model``: the parameters each rank built, whole, before parallelism split them, against the workload's count of
  the size the record names (a config model's: the shrunk size's on CPU ranks, the config's at full size).

Each entry is ``{"claim", "value", "status", "compared" | "reason"}`` with status ``checked``, ``contradicted``
or ``n/a`` (not checkable here, and why). A contradicted claim makes the cell ``contradicted``
(:data:`harness.records.record.STATUSES`): its metrics are kept as evidence, never shown as a measured row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.model.comm import comm_by_rank, comm_for_routing
from harness.model.op_step import block_runs
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import checkpointed_layer
from harness.parallel.schedules import ZERO_BUBBLE_SCHEDULES
from harness.spec import CellConfig
from workloads.own_model import OwnModel

CHECKED, CONTRADICTED, NA = "checked", "contradicted", "n/a"


def _entry(claim: str, value: Any, ok: bool | None, text: str) -> dict[str, Any]:
    status = NA if ok is None else CHECKED if ok else CONTRADICTED
    return {"claim": claim, "value": value, "status": status, ("reason" if ok is None else "compared"): text}


def expected_recompute(policy: str, blocks: Mapping[str, Mapping[str, int]],
                       runs: Mapping[int, float] | None = None) -> float:
    """Matmuls ``policy`` recomputes in a backward, from what each block's forward calls ran (``Tally.blocks``):
    a whole checkpointed block (``full``, ``layerN``'s) every matmul, ``op`` the 2nd, 4th, ... of each call,
    ``attn`` its attention's but the output projection's; ``none`` nothing; each block's ``runs`` times where a
    split backward recomputes it more than once (:func:`split_runs`). Blocks by layer index, or in order where their
    names are not numbers (a module of your own)."""
    total = 0.0
    for i, (name, b) in enumerate(blocks.items()):
        layer = int(name) if name.isdigit() else i
        times = 1.0 if runs is None else runs[layer]
        if checkpointed_layer(policy, layer):
            total += times * b["matmuls"]
        elif policy == "op":
            total += times * b["every_other"]
        elif policy == "attn":
            total += times * b["attn_core"]
    return total


def split_runs(cfg: CellConfig) -> dict[int, float] | None:
    """Per block, how many times the cell's pipelined backward runs its recomputation per microbatch
    (:func:`harness.model.op_step.recomputes`: once, or per autograd pass of a split backward that unpacks it); None
    for a module of your own, whose blocks are not traced."""
    return None if isinstance(cfg.model_size, OwnModel) else block_runs(CellShape.of(cfg))


def _ac(cfg: CellConfig, observed: list[dict]) -> dict[str, Any]:
    """Recomputed matmuls equal to the policy's on every rank; under a zero-bubble schedule the policy's times the
    autograd passes that run each block's recomputation (:func:`split_runs`: the input pass and one per weight group
    in the block, on the backwards the schedule splits; measured 5x and 9x the policy's on the two ranks of gpt2's
    ``pp`` zb with ``ac full``, 2.5x and 4x with ``ac attn``); a module of your own's there at least the policy's."""
    split = cfg.layout.dims.pp_enabled and cfg.pp_schedule in ZERO_BUBBLE_SCHEDULES
    runs = split_runs(cfg) if split and cfg.ac != "none" else None
    off, factors = [], []
    for rank, o in enumerate(observed):
        t = o["ops"]
        recomputed = t["backward_matmuls"] - 2 * t["forward_matmuls"]
        once = expected_recompute(cfg.ac, t["blocks"])
        want = expected_recompute(cfg.ac, t["blocks"], runs)
        ok = abs(recomputed - want) < 1e-6 or (split and runs is None and once > 0 and recomputed >= once)
        factors.append(recomputed / once if once else None)
        if not ok:
            off.append(f"rank {rank}'s backward ran {t['backward_matmuls']} matmuls for {t['forward_matmuls']} in its "
                       f"forward: {recomputed} recomputed, where ac {cfg.ac} recomputes {want:g} of what its blocks ran"
                       + (" (its split backward's passes counted)" if runs is not None else
                          " (or more, under a split backward: it recomputes per autograd pass)" if split else ""))
    if off:
        return _entry("ac", cfg.ac, False, "; ".join(off))
    t = observed[0]["ops"]
    times = "" if not split or all(f in (None, 1.0) for f in factors) else \
        f"; recomputed {factors} times the policy's by rank" + (
            ", as many as its split backward's passes" if runs is not None else
            " (a split backward recomputes per pass)")
    return _entry("ac", cfg.ac, True, f"matmuls recomputed on the counted step equal the policy's on every rank "
                  f"(rank 0: {t['backward_matmuls'] - 2 * t['forward_matmuls']} of {t['forward_matmuls']} forward)"
                  f"{times}")


def _optimizer(cfg: CellConfig, observed: list[dict]) -> dict[str, Any]:
    calls = [o["ops"]["ops"].get("fused_adamw", 0) for o in observed]
    fused = cfg.optimizer == "adamw-fused"
    ok = all(c > 0 for c in calls) if fused else not any(calls)
    return _entry("optimizer", cfg.optimizer, ok,
                  f"torch's fused AdamW kernel (aten._fused_adamw_) dispatched {calls} time(s) by rank on the counted "
                  f"step; {'each rank must' if fused else 'no rank may'} run it")


def _compile(cfg: CellConfig, worker: Mapping[str, Any], observed: list[dict]) -> dict[str, Any]:
    frames = [o["frames_compiled"] for o in observed]
    if cfg.compile:
        warm = (worker.get("compile") or {}).get("frames_compiled", 0)
        return _entry("compile", "on", warm > 0 and all(f > 0 for f in frames),
                      f"dynamo compiled {frames} frame(s) by rank over the cell's steps ({warm} in warmup); "
                      f"compile on compiles each block's forward")
    return _entry("compile", "off", not any(frames),
                  f"dynamo compiled {frames} frame(s) by rank over the cell's steps; an eager cell compiles none")


def layout_levers(cfg: CellConfig) -> list[str]:
    """What the collectives vouch for: the layout and each lever that changes a collective."""
    dims = cfg.layout.dims
    out = [f"{cfg.strategy} ({', '.join(f'{k} {v}' for k, v in dims.degrees().items())})"]
    if dims.tp_enabled:
        out.append(f"sequence parallel {'on' if dims.sequence_parallel else 'off'}")
        out.append(f"loss parallel {'on' if dims.loss_parallel else 'off'}")
    if cfg.precision == "fp8" and dims.fsdp_enabled:
        out.append(f"float8 all-gather {'on' if cfg.fp8_all_gather else 'off'}")
    if dims.pp_enabled:
        out.append(f"{cfg.microbatches} microbatches")
    return out


def _first_difference(counted: list[dict], model: list[dict]) -> str:
    if len(counted) != len(model):
        return f"{len(counted)} rank(s) counted, the model has {len(model)}"
    for rank, (c, m) in enumerate(zip(counted, model, strict=True)):
        for kind in sorted(set(c) | set(m)):
            a, b = c.get(kind, {}), m.get(kind, {})
            if a != b:
                return (f"rank {rank}'s {kind}: counted {a.get('calls_per_step', 0):g} call(s), "
                        f"{a.get('bytes_per_step', 0):,.0f} bytes; the model {b.get('calls_per_step', 0):g}, "
                        f"{b.get('bytes_per_step', 0):,.0f}")
    return "the counts differ only below a byte"


def _layout(cfg: CellConfig, worker: Mapping[str, Any]) -> dict[str, Any]:
    levers = layout_levers(cfg)
    counted = worker.get("comm_by_rank")
    if counted is None:
        return _entry("layout", levers, None, "n/a: the record has no collectives counted per rank")
    if isinstance(cfg.workload, OwnModel) and cfg.layout.dims.tp_enabled:
        return _entry("layout", levers, None, "n/a: a module of your own under its factory's tensor parallel plan: "
                      "the model does not price its collectives")
    shape = CellShape.of(cfg)
    ep = (worker.get("moe") or {}).get("ep")
    model = comm_for_routing(shape, ep) if ep else comm_by_rank(shape)
    routed = " (the all-to-alls at the rows each rank recorded routing)" if ep else ""
    if _rounded(counted) == _rounded(model):
        return _entry("layout", levers, True, f"every rank's collectives (calls and bytes per kind) equal the "
                      f"model's for this layout{routed}")
    return _entry("layout", levers, False, f"{_first_difference(counted, model)}{routed}")


def _rounded(comm: list[dict]) -> list[dict]:
    return [{k: {f: round(float(x)) for f, x in v.items()} for k, v in rank.items()} for rank in comm]


def _fp8(cfg: CellConfig, observed: list[dict]) -> dict[str, Any]:
    recipes = sorted({r for o in observed for r in o["fp8"]["recipes"]})
    gather = sorted({g for o in observed for g in o["fp8"]["float8_all_gather"]})
    ok = recipes == [cfg.fp8_recipe] and gather == [cfg.fp8_all_gather]
    return _entry("fp8", {"recipe": cfg.fp8_recipe, "float8_all_gather": cfg.fp8_all_gather}, ok,
                  f"the float8 linears' configs on every rank: recipe(s) {recipes or 'none'}, float8 all-gather "
                  f"{gather or 'none'}")


def _schedule(cfg: CellConfig, worker: Mapping[str, Any]) -> dict[str, Any]:
    actions = ((worker.get("pipeline") or {}).get("actions_ms_by_rank"))
    if not actions or any(a is None for a in actions):
        return _entry("pp_schedule", cfg.pp_schedule, None,
                      "n/a: the stage actions are timed on CPU ranks only (on a GPU the host's clock does not time "
                      "a stage's kernels); the layout's sends and receives are checked with the collectives")
    zero_bubble = cfg.pp_schedule in ZERO_BUBBLE_SCHEDULES
    split = [a["backward_weight"] > 0 and a["backward_input"] > 0 for a in actions]
    whole = [a["backward"] > 0 for a in actions]
    ok = all(split) if zero_bubble else (all(whole) and not any(split))
    return _entry("pp_schedule", cfg.pp_schedule, ok,
                  f"the stage actions each rank timed: a split backward (input, then weight) on ranks "
                  f"{[r for r, s in enumerate(split) if s]}, a whole backward on {[r for r, w in enumerate(whole) if w]}; "
                  f"{cfg.pp_schedule} {'splits every rank' if zero_bubble else 'splits none'}'s backward "
                  f"(gpipe and 1f1b differ in order only, which the clock does not keep)")


def _checkpoint(cfg: CellConfig, worker: Mapping[str, Any]) -> dict[str, Any]:
    ckpt = worker.get("checkpoint") or {}
    saves, written = ckpt.get("saves", 0), ckpt.get("bytes_written_by_rank") or []
    if cfg.checkpoint == "off":
        return _entry("checkpoint", "off", not saves, f"{saves} save(s) logged; checkpoints off saves none")
    due = cfg.steps // cfg.checkpoint_every  # a save after every checkpoint_every-th measured step
    resumed = ((ckpt.get("start") or {}).get("kind") or "fresh") == "resume"
    count_ok = (saves <= due) if resumed else (saves == due)
    ok = ckpt.get("mode") == cfg.checkpoint and count_ok and (saves == 0 or (len(written) == cfg.world_size
                                                                            and all(written)))
    return _entry("checkpoint", cfg.checkpoint, ok,
                  f"{saves} save(s) logged in mode {ckpt.get('mode')!r}, bytes written by rank {written}; "
                  f"{cfg.steps} measured steps, a save every {cfg.checkpoint_every}: {due} due"
                  + (" (an attempt resumed after some of them: at most)" if resumed else ""))


def _routing(cfg: CellConfig, worker: Mapping[str, Any]) -> dict[str, Any]:
    worst = (worker.get("moe") or {}).get("imbalance_max_over_mean_worst")
    if worst is None:
        return _entry("moe_routing", cfg.moe_routing, None, "n/a: no expert loads were recorded")
    if cfg.moe_routing == "balanced":
        return _entry("moe_routing", "balanced", abs(worst - 1.0) < 1e-9,
                      f"busiest expert over the mean, worst layer-step: {worst:.4f}; balanced routing gives 1")
    if worst > 1.0:
        return _entry("moe_routing", "learned", True, f"busiest expert over the mean, worst layer-step: {worst:.4f} "
                      f"(the router's own choice; balanced routing gives 1)")
    return _entry("moe_routing", "learned", None, "n/a: every expert got the same rows on every step, which a learned "
                  "router can also do")


def model_label(size: Any) -> str:
    """What a record says ran: a built-in size's name, a config model's with its shrink (or full size), a module's."""
    origin = getattr(size, "origin", None)
    if origin is None or isinstance(size, OwnModel):
        return str(size.name)
    return f"{origin.name} " + (f"shrunk by rules {origin.shrink}" if origin.shrink else "at full size")


def _model(cfg: CellConfig, observed: list[dict]) -> dict[str, Any]:
    """Every rank built the model whose parameters the record counts (``params_built``, before any sharding)."""
    size = cfg.model_size
    label = model_label(size)
    built = [o.get("params_built") for o in observed]
    if any(b is None for b in built):
        return _entry("model", label, None, "n/a: the record has no count of the parameters built")
    off = [f"rank {r} built {b:,}" for r, b in enumerate(built) if b != size.params]
    if off:
        return _entry("model", label, False, f"{', '.join(off)} parameters; {label} has {size.params:,}")
    return _entry("model", label, True, f"every rank built {size.params:,} parameters, as {label} has")


def judge(cfg: CellConfig, worker: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``metrics.claims`` of an ok cell from its worker metrics (``observed``: each rank's evidence)."""
    observed = (worker.get("observed") or {}).get("by_rank")
    out = [_layout(cfg, worker), _checkpoint(cfg, worker)]
    if observed:
        out += [_ac(cfg, observed), _optimizer(cfg, observed), _compile(cfg, worker, observed), _model(cfg, observed)]
        if cfg.precision == "fp8":
            out.append(_fp8(cfg, observed))
    else:
        out.append(_entry("ac", cfg.ac, None, "n/a: the record has no counted step's ops (recorded before claims)"))
    if cfg.layout.dims.pp_enabled:
        out.append(_schedule(cfg, worker))
    if getattr(cfg.model_size, "moe", None) is not None:
        out.append(_routing(cfg, worker))
    return out


def contradicted(claims: list[dict[str, Any]]) -> str | None:
    """The error line of a cell whose run contradicts a claim, or None."""
    off = [f"{c['claim']} {c['value']}: {c['compared']}" for c in claims if c["status"] == CONTRADICTED]
    return ("claim contradicted by the run: " + " | ".join(off)) if off else None
