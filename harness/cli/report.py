"""``harness report`` (tables and plots from a run's records) and ``harness workloads`` (the size table)."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from harness.cli.arg_values import choices, model_notes, models_arg, path_arg
from harness.cli.args import Settings
from harness.errors import UsageError
from harness.records.reader import load_run, records_file
from harness.report import write_report
from workloads.data import MarkovData
from workloads.describe import block_summary
from workloads.own_model import OwnModel
from workloads.shrink import shrink
from workloads.sizes import ARCHS, FAMILIES, FLOP_CONVENTION_LABEL, FLOP_CONVENTIONS, ModelSize


def cmd_report(args: argparse.Namespace) -> int:
    if records_file(args.dir) is None:
        raise UsageError(f"{args.dir}: no records.jsonl there; pass a run directory written by harness bench")
    load_run(args.dir)  # refused here, as by every reader, when damaged or empty
    print(write_report(args.dir))
    return 0


def _published(s) -> str:
    if not s.tied_published:
        return "same"
    return f"{s.params_published:,} (tied head)"


def _workload_rows(sizes: list[ModelSize]) -> tuple[list[list], list[str]]:
    """One row per size; where any has experts, the counts are split into total and active parameters."""
    rows = []
    moe = any(s.moe is not None for s in sizes)
    for s in sizes:
        floor = MarkovData(s.vocab_size, s.seq_len).entropy_floor if s.vocab_size <= 4096 else None
        flops = s.flops_by_convention()
        experts: list = []
        if moe:
            m = s.moe
            experts = [m.n_experts, m.top_k, m.n_shared, m.balancing] if m is not None else ["-"] * 4
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


def _model_section(models: tuple[ModelSize | OwnModel, ...]) -> list[str]:
    """Each ``--model``'s rows, as given and shrunk for CPU ranks, what its block maps onto, and the mapping's notes
    (a module of your own: what is counted of it)."""
    out = []
    for m in models:
        if isinstance(m, OwnModel):
            out += [f"## {m.name}", "", *model_notes((m,)), ""]
            continue
        shrunk = shrink(m)
        rows, headers = _workload_rows([m, shrunk])
        assert m.origin is not None
        out += [f"## {m.name} ({m.origin.name}, sha256 {m.origin.digest})", "",
                tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), "",
                f"block: {block_summary(m)}", f"shrunk for CPU ranks ({shrunk.origin.shrink if shrunk.origin else ''}; "
                f"docs/models.md): {block_summary(shrunk)}", *(f"note: {n}" for n in m.origin.notes), ""]
    return out


def cmd_workloads(args: argparse.Namespace) -> int:
    if args.model is not None and args.arch is not None:
        raise UsageError("--model with --arch: --model lists your own model; --arch the built-in families; give one")
    models = models_arg(Settings({"model": args.model}) if args.model is not None else Settings({}), "cuda")
    if models:
        print("\n".join(_model_section(models)))
    else:
        for arch in (choices("--arch", args.arch, ARCHS) if args.arch else ARCHS):
            rows, headers = _workload_rows(list(FAMILIES[arch].values()))
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
    r.add_argument("dir", type=path_arg)
    r.set_defaults(fn=cmd_report)
    w = sub.add_parser("workloads", help="print each family's sizes: parameters and FLOPs per token")
    w.add_argument("--arch", help="families to list: gpt2,llama3,moe (default all)")
    w.add_argument("--model", help="your own model instead: a config.json or a folder holding one (a list: each), "
                                   "as given and shrunk for CPU ranks")
    w.set_defaults(fn=cmd_workloads)
