"""``harness report`` (tables and plots from a run's records) and ``harness workloads`` (the size table)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from harness.cli.args import choices
from harness.errors import UsageError
from harness.records.reader import records_file
from harness.report import write_report
from workloads.data import MarkovData
from workloads.sizes import ARCHS, FAMILIES, FLOP_CONVENTION_LABEL, FLOP_CONVENTIONS


def cmd_report(args: argparse.Namespace) -> int:
    if records_file(args.dir) is None:
        raise UsageError(f"{args.dir}: no records.jsonl there; pass a run directory written by harness bench")
    print(write_report(args.dir))
    return 0


def _published(s) -> str:
    if not s.tied_published:
        return "same"
    return f"{s.params_published:,} (tied head)"


def _workload_rows(arch: str) -> tuple[list[list], list[str]]:
    """One row per size of ``arch``; an MoE's counts are split into total and active parameters."""
    rows = []
    moe = arch == "moe"
    for s in FAMILIES[arch].values():
        floor = MarkovData(s.vocab_size, s.seq_len).entropy_floor if s.vocab_size <= 4096 else None
        flops = s.flops_by_convention()
        experts: list = []
        if moe:
            assert s.moe is not None, f"{s.key}: an moe size without its MoESpec"
            experts = [s.moe.n_experts, s.moe.top_k, s.moe.n_shared, s.moe.balancing]
        active = [f"{s.params_active:,}", f"{s.params_active_nonembedding:,}"] if moe else []
        total_flops = [f"{s.flops_per_token_total() / 1e6:,.1f}"] if moe else []
        rows.append([s.name, s.device_kind, s.n_layers, s.d_model, s.n_heads, s.kv_heads, *experts, s.d_ff, s.seq_len,
                     s.vocab_size, f"{s.params:,}", *active, _published(s), f"{s.params_nonembedding:,}",
                     *(f"{flops[k] / 1e6:,.1f}" for k in FLOP_CONVENTIONS), *total_flops,
                     f"{floor:.3f}" if floor else "-"])
    headers = ["size", "runs on", "layers", "d_model", "heads", "kv heads",
               *(["experts", "top-k", "shared", "balancing", "expert d_ff"] if moe else ["d_ff"]), "seq_len", "vocab",
               "params (trained)", *(["params active", "N active"] if moe else []), "params (published)",
               "N (non-embed)", *(f"MFLOP/token {k}" + (" (active)" if moe else "") for k in FLOP_CONVENTIONS),
               *(["MFLOP/token palm on total params (wrong for MFU)"] if moe else []), "entropy floor (nats)"]
    return rows, headers


def cmd_workloads(args: argparse.Namespace) -> int:
    archs = choices("--arch", args.arch, ARCHS) if args.arch else ARCHS
    for arch in archs:
        rows, headers = _workload_rows(arch)
        print(f"## {arch}\n")
        print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
        print()
    print("params (trained): the model the harness builds, LM head always untied so tensor and pipeline parallel "
          "can place it; params (published): the released checkpoint's count where it ties the head (Llama 3.2 "
          "1B, 3B). FLOPs per token at the size's seq_len, forward + backward, N = all parameters but the "
          "embedding tables (an MoE's active ones: attention, router, top-k routed and shared experts, head): "
          + "; ".join(f"{k}: {FLOP_CONVENTION_LABEL[k]}" for k in FLOP_CONVENTIONS)
          + ". runs on: cpu/gpu sizes bench anywhere; plan sizes are for harness plan and harness fit only.")
    return 0


def register(sub) -> None:
    r = sub.add_parser("report", help="rebuild summary.md, summary.csv and plots from a run's records")
    r.add_argument("dir", type=Path)
    r.set_defaults(fn=cmd_report)
    w = sub.add_parser("workloads", help="print each family's sizes: parameters and FLOPs per token")
    w.add_argument("--arch", help="families to list: gpt2,llama3,moe (default all)")
    w.set_defaults(fn=cmd_workloads)
