"""The what-if plan as text: a PREDICTIONS banner, the assumptions, the ranked table, the model's error.

Formatting only; the numbers come from :mod:`harness.model.whatif`.
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from harness.model.checkpoint_cost import DEFAULT_WRITE_GBPS
from harness.model.whatif import EXPLAIN, TOKENS_PER_DEVICE, Scenario, sequences_per_device
from harness.text import degrees_label
from workloads.sizes import FLOP_CONVENTION_LABEL

BANNER = ("PREDICTIONS from the analytic model (harness/model), not measurements: "
          "nothing here ran on the named hardware.")


def _peak(s: Scenario) -> str:
    """The peak the compute runs at: the precision's datasheet peak, or fp8's split between float8 and bf16."""
    if s.fp8_fraction is None:
        return f"{s.precision} datasheet peak {s.peak_tflops:g}"
    return (f"{s.compute_peak_tflops:.1f} for fp8's split (its float8 linears {100 * s.fp8_fraction:.1f}% of the model "
            f"FLOPs at the fp8 datasheet peak {s.peak_tflops:g}, the rest, attention and LM head, at bf16's "
            f"{s.device.peak_tflops['bf16']:g})")


def compute_lines(s: Scenario) -> list[str]:
    """How the compute is priced: op by op with the device's rates and their sources, or one ``--efficiency``."""
    d = s.device
    cap = f" x power cap {d.compute_scale:.3f}" if d.compute_scale != 1 else ""
    if s.efficiency is not None:
        return [f"compute: {s.compute_peak_tflops * d.compute_scale * s.efficiency:.1f} TFLOP/s per GPU = " + _peak(s) +
                cap + f" x {s.efficiency:.3f} (--efficiency: one fraction for every op)"]
    r = d.op_rates
    sources = dict(r.sources)
    gemm = dict(r.gemm_tflops)
    dtype = "bf16" if s.precision in ("bf16", "fp8") else s.precision
    att = r.attention.fraction(False, s.size.head_dim, s.size.seq_len)
    lines = [
        f"compute: priced op by op (harness/model/op_step.py): every kernel a rank's microbatch runs, traced at its "
        f"shape; GEMMs at {gemm.get(dtype, 0):,.1f} TFLOP/s {dtype}" +
        (f" and {gemm['fp8']:,.1f} fp8" if s.precision == "fp8" and "fp8" in gemm else "") +
        f" achievable{cap} x each shape's wave efficiency over {r.sms} SMs ({sources['gemm_tflops']}); flash "
        f"attention at {100 * att:.1f}% of the {dtype} peak forward at seq {s.size.seq_len} "
        f"({sources['attention']}); every other kernel at its bytes over {r.bandwidth_efficiency:.3f} x "
        f"{d.hbm_gbps:,.0f} GB/s ({sources['bandwidth_efficiency']}); {r.launch_s * 1e6:g} us of host time per "
        f"eager op ({sources['launch_s']}); kernel floor {r.kernel_floor_s * 1e6:g} us ({sources['kernel_floor_s']})",
        f"kernels: RMSNorm {'fused (torch 2.8 onwards)' if s.fused_rms_norm else 'as separate kernels (--rms-norm composite: torch before 2.8)'}"
        + (f"; compiled: the blocks, each run of memory-bound kernels between two matmuls one kernel, those with a "
           f"norm, softmax or loss at {s.inductor_reductions:g} of the bandwidth (--inductor-reductions), the ends "
           f"eager" if s.compile is not None else "")
        + ("; fp8: torchao's float8 GEMMs, each operand's amax and scaled cast as memory-bound kernels (two eager, "
           "one pass compiled)" if s.precision == "fp8" else ""),
    ]
    return lines


def assumptions_lines(s: Scenario) -> list[str]:
    d = s.device
    per_device = sequences_per_device(s.size.seq_len)
    nodes = f"{s.gpus} GPUs = {s.nodes} node(s) x {d.gpus_per_node}" if s.gpus > d.gpus_per_node else \
        f"{s.gpus} GPUs on one node of {d.gpus_per_node}"
    batch = f"global batch {s.global_batch} sequences" if s.global_batch else \
        f"global batch {per_device * s.gpus} sequences ({per_device} per device, at most {TOKENS_PER_DEVICE:,} tokens; " \
        f"context-parallel rows {per_device} per cp devices, which split each sequence; --batch sets it)"
    moe = s.size.moe is not None
    active = f", {_params(s.size.params_active)} active" if moe else ""
    on_active = " on active parameters" if moe else ""
    total = (f"; counted on every parameter as if active it would be {s.size.flops_per_token_total() / 1e9:,.2f} "
             f"GFLOP, which overstates an MoE's MFU") if moe else ""
    return [
        f"device: {d.product} (--device {d.name}), {nodes}; {d.hbm_gib:.1f} GiB HBM at {d.hbm_gbps:,.0f} GB/s" +
        (f"; overridden: {'; '.join(d.overrides)}" if d.overrides else ""),
        *compute_lines(s),
        f"interconnect: {d.intra.name} {d.intra.gbps:g} GB/s/direction, NCCL at {d.intra.nccl_gbps:.0f} "
        f"({d.intra.nccl_source}; {d.intra.latency_s * 1e6:g} us) in a node; {d.inter.name} {d.inter.gbps:g} GB/s per "
        f"GPU NIC, NCCL at {d.inter.nccl_gbps:.0f} ({d.inter.nccl_source}; {d.inter.latency_s * 1e6:g} us) across nodes; "
        f"tp innermost on NVLink, a group spanning nodes at min(NVLink, its GPUs per node x NIC)",
        f"workload: {s.size.arch} {s.size.name} ({_params(s.size.params)} params{active}), seq {s.size.seq_len}, "
        f"{batch}, pp schedule {s.pp_schedule}, recompute {s.recompute}; peaks exclude the CUDA context and NCCL buffers",
        f"MFU: model FLOPs per token{on_active} by {FLOP_CONVENTION_LABEL['palm']} = "
        f"{s.size.flops_per_token() / 1e9:,.2f} GFLOP (torchtitan counts {s.size.flops_per_token_torchtitan() / 1e9:,.2f}), "
        f"and by {FLOP_CONVENTION_LABEL['megatron']} = {s.size.flops_per_token_megatron() / 1e9:,.2f} GFLOP "
        f"(Megatron-Bridge's count); recompute not counted{total}",
    ] + _compile_lines(s) + _checkpoint_lines(s) + ([f"expert load: {'balanced (every expert the mean)' if s.moe_imbalance == 1 else f'the busiest expert at {s.moe_imbalance:.3g}x the mean (--moe-imbalance)'}; "
          f"under expert parallel the busiest rank's expert compute scales with it; all-to-all priced as "
          f"if each rank receives as many routed rows as it sends"] if moe else [])


def _checkpoint_lines(s: Scenario) -> list[str]:
    if s.checkpoint_every is None:
        return []
    assumed = ", assumed (--checkpoint-gbps sets it; no filesystem of the named hardware is measured)" \
        if s.checkpoint_gbps == DEFAULT_WRITE_GBPS else " (--checkpoint-gbps)"
    return [f"checkpoint: a synchronous save every {s.checkpoint_every} steps of each rank's parameters and AdamW "
            f"state (12 bytes a parameter over its data-parallel replicas), written at {s.checkpoint_gbps:g} GB/s per "
            f"GPU{assumed}; % of step = save s / ({s.checkpoint_every} x step s)"]


def _compile_lines(s: Scenario) -> list[str]:
    if s.compile is None:
        return []
    if s.efficiency is None:
        measured = f"; measured on this device: {s.compile.speedup:.3f}x ({s.compile.source})" if s.compile.speedup \
            else ""
        return ["compile: priced as fusion: each run of memory-bound kernels between two GEMMs or attentions one "
                "kernel, reading what comes from outside it and writing what is read after it" + measured]
    if not s.compile.speedup:
        return [f"compile: not priced ({s.compile.source}); the rows are eager"]
    return [f"compile: the compute {s.compile.speedup:.3f}x faster, the median gain measured on this device "
            f"({s.compile.source})"]


def _num(x: float, decimals: int = 1) -> str:
    """Fixed decimals, or 3 significant digits for values that would print as 0 (tiny sizes)."""
    return f"{x:.{decimals}f}" if x == 0 or abs(x) >= 10 ** -decimals else f"{x:.3g}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


CHECKPOINT_COLUMNS = ["checkpoint GiB/rank", "save s", "checkpoint % of step"]


def whatif_table(rows: list[dict]) -> str:
    """The ranking; with ``--checkpoint-every`` each row's save priced too (:mod:`harness.model.checkpoint_cost`)."""
    ckpt = any("checkpoint_save_s" in r for r in rows)
    out = []
    for r in rows:
        if not r["valid"]:
            out.append(["-", r["strategy"], *["-"] * (9 + 3 * ckpt), "invalid", r["reason"]])
            continue
        note = "; ".join(([r["reason"]] if r["reason"] else []) + r["notes"])
        priced = [_num(r["checkpoint_gib_per_rank"], 2), _num(r["checkpoint_save_s"]), _num(r["checkpoint_pct"], 2)] \
            if ckpt else []
        out.append([r["rank"] or "-", r["strategy"], degrees_label(r["degrees"]), f"{r['tokens_per_s_per_device']:,.0f}",
                    f"{r['mfu_pct']:.1f}", f"{r['mfu_megatron_pct']:.1f}", _num(r["step_time_s"] * 1e3), _num(r["exposed_comm_s"] * 1e3),
                    _num(r["bubble_s"] * 1e3), _num(r["model_states_gib_per_rank"], 2),
                    _num(r["peak_mem_gib_per_rank"]), *priced, "yes" if r["fits"] else "NO", note])
    return tabulate(out, headers=["rank", "strategy", "degrees", "tokens/s/device", "MFU % (PaLM)",
                                  "MFU % (Megatron causal)", "step ms",
                                  "exposed comm ms", "bubble ms", "model states GiB/rank", "peak GiB/rank",
                                  *(CHECKPOINT_COLUMNS if ckpt else []), "fits", "note"], tablefmt="github",
                    disable_numparse=True, colalign=("right", "left", "left") + ("right",) * (8 + 3 * ckpt) + ("left", "left"))


def explain_table(rows: list[dict]) -> str:
    """Where each valid row's step goes (``plan --explain``): ms and % of the step by part (:data:`EXPLAIN`)."""
    out = []
    for r in rows:
        parts = r.get("explain")
        if not r["valid"] or parts is None:
            continue
        step = r["step_time_s"]
        out.append([r["rank"] or "-", r["strategy"], degrees_label(r["degrees"]), _num(step * 1e3),
                    *(f"{_num(parts[k] * 1e3)} ({100 * parts[k] / step:.0f}%)" for k in EXPLAIN)])
    return tabulate(out, headers=["rank", "strategy", "degrees", "step ms", *(f"{k} ms (%)" for k in EXPLAIN)],
                    tablefmt="github", disable_numparse=True)


def error_line(err: dict, run_dir: Path) -> str:
    if "reason" in err:
        return (f"model error: n/a: {err['reason']}; run harness bench --device cpu --gpus 2,4 --out {run_dir} "
                f"with the model's predictions in its records to measure it")
    return (f"model error: mean {err['mean_pct']:.1f}%, max {err['max_pct']:.1f}% ({err['worst_cell']}) "
            f"|predicted - measured| step time over {err['n']} cells measured on {err['device_kind'] or '?'} "
            f"in {run_dir}; the error on the hardware above is not measured")
