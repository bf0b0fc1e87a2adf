"""Rank strategies for a model size on N GPUs nobody here has: predictions from the analytic model.

For each strategy, :func:`plan_at_scale` resolves the preset degrees (or ``--degrees``), checks
them as the sweep planner does (an invalid one is a row with its reason), and prices one
optimizer step with :func:`harness.model.step_time.predict_step`:

* compute op by op (:mod:`harness.model.op_step`): every kernel a rank's microbatch runs, traced at its real shape
  (recomputation, fp8's casts and compile's fusion included), each at its own rate on the device (GEMMs by their
  shape, attention by flash attention's measured rate, everything else by the bytes it moves), AdamW by its bytes;
  with ``--efficiency`` instead, the model FLOPs at ``datasheet peak x efficiency`` (one fraction for every op,
  :func:`harness.model.compute.roofline_rates`), recomputation adding its forward FLOPs;
* communication at :func:`harness.model.hardware.comm_time_fn` (alpha-beta over NVLink / NIC),
  hiding what the strategy overlaps behind compute (GPU streams);
* memory from :mod:`harness.model.memory` (exact model states, activations, transients).

MFU is ``model FLOPs per token x tokens/s per device / datasheet peak`` (recompute not counted,
as in the measured records). Rank 1 is the most tokens/s per device among strategies whose
predicted peak fits the device memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from harness.errors import UsageError
from harness.model.block_ops import fp8_flops_fraction
from harness.model.checkpoint_cost import DEFAULT_WRITE_GBPS, checkpoint_bytes_by_rank, cost_per_step, save_seconds
from harness.model.compute import ComputeRates, roofline_rates, with_recompute
from harness.model.hardware import GIB, Device, comm_time_fn, get_device, placement
from harness.model.memory import peak_bytes, state_bytes_by_rank
from harness.model.op_cost import Device as PricedDevice
from harness.model.op_cost import PassCost
from harness.model.op_step import block_runs, optimizer_s_per_param, rank_passes
from harness.model.shape import LOW_BYTES, CellShape
from harness.model.step_time import OVERLAP_SLOWDOWN, StepPrediction, predict_step
from harness.parallel import presets
from harness.parallel.activation_checkpoint import ac_policy
from harness.parallel.dims import ParallelDims
from harness.parallel.presets import STRATEGIES, resolve, resolve_cell, world_for
from harness.parallel.schedules import PP_SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_schedule_ac
from harness.precision import Fp8Options
from workloads.sizes import ModelSize, get_size, seq_len_error

SEQUENCES_PER_DEVICE = 8
TOKENS_PER_DEVICE = 8192
"""Default global batch: 8,192 tokens per device, at most 8 sequences: 8 sequences at seq 1024
(0.5M tokens on 64 GPUs, the order of GPT-3 XL's 1M-token batch, Brown et al. 2020 table 2.1; the
harness's one-device GPU default batch, scaled like ``--scaling weak``), one at Llama 3's 8,192."""


def sequences_per_device(seq_len: int) -> int:
    """The default batch per device at ``seq_len`` (:data:`TOKENS_PER_DEVICE`)."""
    return max(1, min(SEQUENCES_PER_DEVICE, TOKENS_PER_DEVICE // seq_len))


DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s != "single")
"""``single`` runs on one device; ask for it with ``--strategies single`` as a reference. A dense size
leaves the expert-parallel presets out (:func:`default_strategies`)."""


def default_strategies(size: ModelSize) -> tuple[str, ...]:
    """What ``plan`` ranks without ``--strategies``: every strategy but ``single``, and for a dense size
    none of the expert-parallel presets, which need experts (named, they are refused with the reason)."""
    return DEFAULT_STRATEGIES if size.moe else tuple(n for n in DEFAULT_STRATEGIES if n not in presets.EP_PRESETS)


@dataclass(frozen=True)
class CompileGain:
    """What ``torch.compile`` bought on the what-if's device, measured: None when nothing was (then the rows
    are priced eager, and say so)."""

    speedup: float | None
    """Median step-time ratio eager / compiled over the measured pairs."""
    source: str
    """Where the pairs were measured, or why there are none."""


@dataclass(frozen=True)
class Scenario:
    """What is held fixed across the strategies of one what-if."""

    size: ModelSize
    device: Device
    gpus: int
    precision: str
    efficiency: float | None
    """Fraction of the datasheet peak the compute runs at (``--efficiency``); None: priced op by op."""
    global_batch: int | None
    """Sequences per optimizer step; None: :func:`default_global_batch`."""
    recompute: str = "none"
    microbatches: int | None = None
    """Pipeline microbatches; None: 2 x pp (the sweep planner's default)."""
    pp_schedule: str = "1f1b"
    grad_accum: int = 1
    degrees: dict | None = None
    moe_imbalance: float = 1.0
    """Busiest expert over the mean load (:attr:`harness.model.shape.CellShape.moe_imbalance`)."""
    sequence_parallel: bool = True
    """Sequence parallel wherever a layout has tensor parallel (:func:`harness.parallel.presets.sp_of`)."""
    compile: CompileGain | None = None
    """``--compile on``: its measured gain on this device, or None when compile is off."""
    checkpoint_every: int | None = None
    """``--checkpoint-every``: a synchronous save every this many steps, priced per row; None: not priced."""
    checkpoint_gbps: float = DEFAULT_WRITE_GBPS
    """Write bandwidth per GPU the saves are priced at (GB/s; ``--checkpoint-gbps``)."""
    fp8_recipe: str = "tensorwise"
    """``fp8``: torchao's scaling recipe (``--fp8-recipe``)."""
    fused_rms_norm: bool = True
    """RMSNorm as torch's fused kernel (torch 2.8 onwards); False: as the separate kernels earlier torch ran
    (``--rms-norm composite``, a published run's software)."""
    inductor_reductions: float = 1.0
    """Under compile, the share of the achievable bandwidth Inductor's fused kernels with a norm, softmax or loss in
    them reach (``--inductor-reductions``; 0.5 for the torch of 2024, :mod:`harness.model.op_cost` gives the
    source)."""

    @property
    def peak_tflops(self) -> float:
        """The datasheet peak at the scenario's precision (what MFU divides by)."""
        return self.device.peak_tflops[self.precision]

    @property
    def fp8_fraction(self) -> float | None:
        """fp8: the share of the model FLOPs its float8 linears run (:func:`harness.model.block_ops.fp8_flops_fraction`)."""
        return fp8_flops_fraction(self.size) if self.precision == "fp8" else None

    @property
    def compute_peak_tflops(self) -> float:
        """The peak the step's FLOPs run at: fp8's float8 linears at the fp8 peak, the rest (attention, LM head,
        an MoE's experts) at bf16's, so fp8's time is ``f / fp8 + (1 - f) / bf16`` per FLOP; else the precision's."""
        f = self.fp8_fraction
        if f is None:
            return self.peak_tflops
        return 1.0 / (f / self.peak_tflops + (1.0 - f) / self.device.peak_tflops["bf16"])

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.device.gpus_per_node)


def scenario(workload: str | ModelSize, device: str | Device, gpus: int, precision: str = "bf16", *,
             global_batch: int | None = None, seq_len: int | None = None, recompute: str = "none",
             microbatches: int | None = None, efficiency: float | None = None, pp_schedule: str = "1f1b",
             grad_accum: int = 1, degrees: dict | None = None, moe_imbalance: float = 1.0,
             sequence_parallel: bool = True, compile: CompileGain | None = None, checkpoint_every: int | None = None,
             checkpoint_gbps: float = DEFAULT_WRITE_GBPS, fused_rms_norm: bool = True,
             fp8_recipe: str = "tensorwise", inductor_reductions: float = 1.0) -> Scenario:
    """Validate the inputs (UsageError naming the value and the fix) and fix the defaults. ``workload``: a size's
    key (``llama3-8b``) or the workload itself (a ``--model``'s, resolved where the user named it)."""
    dev = get_device(device) if isinstance(device, str) else device
    try:
        size = get_size(workload) if isinstance(workload, str) else workload
    except ValueError as e:
        raise UsageError(f"--sizes: {e}") from None
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise UsageError(f"--gpus {gpus!r}: must be an integer >= 1")
    if precision not in LOW_BYTES or precision not in dev.peak_tflops:
        fix = (f"; or give {precision} = <TFLOP/s> under [peak_tflops] in {dev.source}"
               if dev.source.endswith(".toml") and precision in LOW_BYTES else "")
        raise UsageError(f"--precision {precision!r}: {dev.name} has no {precision} peak; choose from "
                         f"{', '.join(dev.peak_tflops)}{fix}")
    try:
        recompute = ac_policy(recompute)
    except UsageError as e:
        raise UsageError(f"--recompute: {e}") from None
    if pp_schedule not in PP_SCHEDULES:
        raise UsageError(f"--pp-schedule {pp_schedule!r}: choose from {', '.join(PP_SCHEDULES)}")
    eff = efficiency
    if eff is not None and not 0 < eff <= 1:
        raise UsageError(f"--efficiency {efficiency!r}: must be a fraction of the datasheet peak in (0, 1], "
                         f"e.g. 0.4")
    if moe_imbalance != 1.0 and (size.moe is None or not moe_imbalance >= 1.0):
        raise UsageError(f"--moe-imbalance {moe_imbalance!r}: the busiest expert's load over the mean, >= 1, for "
                         f"--arch moe only (e.g. a record's metrics.moe.imbalance_max_over_mean)")
    if seq_len is not None:
        if error := seq_len_error(size, seq_len):
            raise UsageError(f"--seq-len: {error}")
        size = replace(size, seq_len=seq_len)
    if checkpoint_every is not None and checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {checkpoint_every}: must be an integer >= 1 (steps between saves)")
    if not checkpoint_gbps > 0:
        raise UsageError(f"--checkpoint-gbps {checkpoint_gbps}: must be a write bandwidth per GPU in GB/s > 0, e.g. 2")
    if not 0 < inductor_reductions <= 1:
        raise UsageError(f"--inductor-reductions {inductor_reductions:g}: must be a share of the bandwidth in (0, 1], "
                         f"e.g. 0.5 for the torch of 2024")
    return Scenario(size=size, device=dev, gpus=gpus, precision=precision, efficiency=eff, global_batch=global_batch,
                    recompute=recompute, microbatches=microbatches, pp_schedule=pp_schedule, grad_accum=grad_accum,
                    degrees=degrees, moe_imbalance=moe_imbalance, sequence_parallel=sequence_parallel, compile=compile,
                    checkpoint_every=checkpoint_every, checkpoint_gbps=checkpoint_gbps, fused_rms_norm=fused_rms_norm,
                    fp8_recipe=Fp8Options(recipe=fp8_recipe).recipe, inductor_reductions=inductor_reductions)


def default_global_batch(seq_len: int, world: int, cp: int) -> int:
    """The default batch (:func:`sequences_per_device` per device) held by the data-parallel ranks: without
    context parallel one per device; with it, one per ``cp`` devices, which split each sequence (torchtitan's
    published CP rows: local batch 1, FSDP degree ``8 / cp``)."""
    return max(1, sequences_per_device(seq_len) * world // cp)


def shape_for(s: Scenario, strategy: str) -> CellShape:
    """The cell a strategy runs at this scale; UsageError (the row's reason) when it cannot run."""
    world = world_for(strategy, s.gpus)
    degrees = s.degrees if strategy != "single" else None
    gb = s.global_batch or default_global_batch(s.size.seq_len, world,
                                                resolve(strategy, world, degrees, s.sequence_parallel).dims.cp)
    layout, mb = resolve_cell(strategy, world, degrees, s.size, s.precision, pp_schedule=s.pp_schedule,
                              microbatches=s.microbatches, grad_accum=s.grad_accum, global_batch=gb,
                              sequence_parallel=s.sequence_parallel)
    return CellShape(size=s.size, dims=layout.dims, strategy=strategy, precision=s.precision, global_batch=gb,
                     grad_accum=s.grad_accum, microbatches=mb, pp_schedule=s.pp_schedule, device_kind="cuda",
                     recompute=s.recompute, moe_imbalance=s.moe_imbalance)


def _op_passes(s: Scenario, c: CellShape, dev: PricedDevice) -> list[PassCost]:
    """Each pipeline rank's microbatch priced op by op under the scenario's software (compile, RMSNorm's kernel,
    fp8's recipe, Inductor's reductions)."""
    return rank_passes(c, dev, compile=s.compile is not None, fused_norm=s.fused_rms_norm, fp8_recipe=s.fp8_recipe,
                       reduction_share=s.inductor_reductions)


def rates_for(s: Scenario, c: CellShape) -> ComputeRates:
    """Each pipeline rank's microbatch priced op by op (:mod:`harness.model.op_step`); with ``--efficiency``, roofline
    rates at ``peak x efficiency`` and the HBM bandwidth, scaled for recomputation."""
    if s.efficiency is None:
        dev = s.device.priced()
        passes = _op_passes(s, c, dev)
        return ComputeRates(alpha_s=0.0, beta_s_per_row=0.0, optimizer_s_per_param=optimizer_s_per_param(c, dev),
                            basis="ops", stage_pass_s=tuple(p.total_s for p in passes))
    r = with_recompute(roofline_rates(c, s.compute_peak_tflops * s.device.compute_scale * s.efficiency,
                                      mem_gbps=s.device.hbm_gbps), c, block_runs(c))
    if s.compile is not None and s.compile.speedup:  # the measured gain, on the compute only
        r = replace(r, beta_s_per_row=r.beta_s_per_row / s.compile.speedup)
    return r


def predict_row(s: Scenario, strategy: str) -> dict:
    """One strategy's predicted step, throughput, MFU and memory (or its reason when invalid)."""
    row: dict = {"strategy": strategy, "seq_len": s.size.seq_len, "valid": False, "reason": None, "rank": None,
                 "fits": None, "notes": []}
    try:
        c = shape_for(s, strategy)
    except UsageError as e:
        row["reason"] = str(e)
        return row
    dims = c.dims
    rates = rates_for(s, c)
    p = predict_step(c, rates, comm_time_fn(s.device, dims), hide_overlappable=True,
                     overlap_slowdown=OVERLAP_SLOWDOWN if s.efficiency is None else 0.0)
    step = p.step_time_s
    assert step is not None, "the hardware table prices every collective"
    tokens_per_device = c.global_batch * c.size.seq_len / step / dims.world_size
    states = max(b.total for b in state_bytes_by_rank(c)) / GIB
    peak = peak_bytes(c, 0.0) / GIB
    fits = peak <= s.device.hbm_gib
    where = placement(dims, s.device.gpus_per_node)
    row.update(
        valid=True, degrees=dims.degrees(), world_size=dims.world_size, global_batch=c.global_batch,
        microbatches=c.microbatches, step_time_s=step, tokens_per_s_per_device=tokens_per_device,
        mfu_pct=100.0 * c.size.flops_per_token() * tokens_per_device / (s.peak_tflops * 1e12),
        mfu_megatron_pct=100.0 * c.size.flops_per_token_megatron() * tokens_per_device / (s.peak_tflops * 1e12),
        compute_s=p.compute_s, optimizer_s=p.optimizer_s, comm_s=p.comm_s, exposed_comm_s=p.exposed_comm_s,
        bubble_s=p.bubble_s, bubble_fraction=p.bubble_fraction, interference_s=p.interference_s,
        model_states_gib_per_rank=states,
        peak_mem_gib_per_rank=peak, fits=fits,
        spans_nodes=sorted(d for d, w in where.items() if w.spans_nodes),
    )
    if not fits:
        row["reason"] = (f"predicted peak {peak:.1f} GiB > {s.device.hbm_gib:.1f} GiB per GPU; shard more "
                         f"(fsdp, tp, pp), --recompute full or a smaller --batch")
    if s.checkpoint_every is not None:
        save_s = save_seconds(c, s.checkpoint_gbps)
        row.update(checkpoint_gib_per_rank=max(checkpoint_bytes_by_rank(c)) / GIB, checkpoint_save_s=save_s,
                   checkpoint_pct=100 * cost_per_step(save_s, s.checkpoint_every, step))
    if s.efficiency is None:
        row["explain"] = explain(s, c, p)
    elif s.compile is not None and not s.compile.speedup:
        row["notes"].append(f"compile: not priced ({s.compile.source})")
    if dims.pp_enabled and s.pp_schedule in ZERO_BUBBLE_SCHEDULES and s.recompute != "none":
        row["notes"].append(f"{s.pp_schedule} with recompute {s.recompute}: torch's split backward runs a checkpointed "
                            f"block's forward again in each autograd pass that unpacks it, the input pass and one per "
                            f"weight group in the block (the first stage once); priced so "
                            f"(harness/model/split_backward.py), and the copies of its saved tensors each weight "
                            f"pass keeps counted in the peak (harness/model/split_memory.py)")
    same = _same_size_dims(dims, where)
    if same:
        row["notes"].append(f"{' and '.join(same)} have the same size: their collectives are priced at the "
                            f"slower placement")
    return row


EXPLAIN = ("gemm", "attention", "memory-bound", "host-bound", "optimizer", "exposed comm", "comm interference",
           "bubble")
"""Where a step goes (``plan --explain``), the parts summing to the step time."""


def explain(s: Scenario, c: CellShape, p: StepPrediction) -> dict[str, float]:
    """The step's seconds by part (:data:`EXPLAIN`): the slowest pipeline rank's compute by kind of kernel (its
    passes of one microbatch), the optimizer, the exposed communication, what the hidden communication slows the
    compute by, and the bubble."""
    costs = _op_passes(s, c, s.device.priced())
    cost = max(costs, key=lambda k: k.total_s)
    passes = c.microbatches if c.dims.pp_enabled else c.grad_accum
    scale = p.compute_s / (passes * cost.total_s) if cost.total_s else 0.0  # an MoE's busiest rank, if any
    n = passes * scale
    return {"gemm": n * cost.seconds["gemm"], "attention": n * cost.seconds["attention"],
            "memory-bound": n * (cost.seconds["memory"] + cost.floor_s), "host-bound": n * cost.host_bound_s,
            "optimizer": p.optimizer_s, "exposed comm": p.exposed_comm_s or 0.0, "comm interference": p.interference_s,
            "bubble": p.bubble_s}


def _same_size_dims(dims: ParallelDims, where: dict) -> list[str]:
    """Dimensions > 1 of equal size, issuing the same collectives, placed differently.

    ``predict_step`` gives the comm time a group size, not a mesh dimension, so such a pair is
    priced at the slower of the two placements (:func:`harness.model.hardware.comm_time_fn`).
    """
    pairs = (("tp", "dp_shard"), ("tp", "dp_replicate"))
    return sorted({d for a, b in pairs if getattr(dims, a) == getattr(dims, b) > 1 and where[a] != where[b]
                   for d in (a, b)})


def rank_rows(rows: list[dict]) -> list[dict]:
    """Rank 1 = most tokens/s per device among valid rows that fit; the rest unranked, last."""
    ok = sorted((r for r in rows if r["valid"] and r["fits"]), key=lambda r: -r["tokens_per_s_per_device"])
    for i, r in enumerate(ok, 1):
        r["rank"] = i
    oom = sorted((r for r in rows if r["valid"] and not r["fits"]), key=lambda r: -r["tokens_per_s_per_device"])
    bad = [r for r in rows if not r["valid"]]
    return ok + oom + bad


def plan_at_scale(workload: str | ModelSize, device: str | Device, gpus: int,
                  strategies: tuple[str, ...] | list[str] | None = None,
                  *, sequence_parallels: tuple[bool, ...] = (True,), pp_schedules: tuple[str, ...] | None = None,
                  **options: Any) -> list[dict]:
    """Predicted rows for each strategy at ``gpus`` devices, ranked (see :func:`rank_rows`); ``options`` are
    :func:`scenario`'s. With ``sequence_parallels=(True, False)`` a layout with tensor parallel appears with and
    without sequence parallel; with ``pp_schedules`` a pipelined layout once per schedule, labelled with it
    where it is not 1F1B (``pp+fsdp+tp (zb)``), its bubble simulated from the schedule's action list."""
    s = scenario(workload, device, gpus, **options)
    check_schedule_ac(pp_schedules or (s.pp_schedule,), (s.recompute,), flag="--recompute")
    names = tuple(strategies) if strategies else default_strategies(s.size)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise UsageError(f"--strategies: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(STRATEGIES)}")
    rows, seen = [], set()
    for n in names:
        for v in degree_variants(s, n):
            for sp, ps in product(sequence_parallels, pp_schedules or (s.pp_schedule,)):
                row = predict_row(replace(v, sequence_parallel=sp, pp_schedule=ps), n)
                if ps != "1f1b" and n in presets.PP_PRESETS:
                    row["strategy"] = f"{n} ({ps})"
                key = (row["strategy"], str(row.get("degrees")), row["reason"])
                if key not in seen:  # a layout without tp is the same with sp on or off
                    seen.add(key)
                    rows.append(row)
    return rank_rows(rows)


def degree_variants(s: Scenario, strategy: str) -> list[Scenario]:
    """The scenario once, or for a context- or expert-parallel preset without ``--degrees`` once per cp (ep)
    degree (:func:`harness.parallel.presets.degree_variants`)."""
    if s.degrees:
        return [s]
    experts = s.size.moe.n_experts if s.size.moe else None
    return [replace(s, degrees=d) for d in presets.degree_variants(strategy, s.gpus, experts)] or [s]
