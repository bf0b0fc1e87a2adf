"""``harness report`` (tables and plots from a run's records) and ``harness workloads`` (the size table)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from harness.errors import UsageError
from harness.records.reader import RECORDS_FILENAME
from harness.report import write_report
from workloads.data import MarkovData
from workloads.sizes import SIZES


def cmd_report(args: argparse.Namespace) -> int:
    if not (args.dir / RECORDS_FILENAME).exists():
        raise UsageError(f"{args.dir}: no records.jsonl there; pass a run directory written by harness bench")
    print(write_report(args.dir))
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    rows = []
    for s in SIZES.values():
        floor = MarkovData(s.vocab_size, s.seq_len).entropy_floor if s.vocab_size <= 4096 else None
        rows.append([s.name, s.n_layers, s.d_model, s.n_heads, s.seq_len, s.vocab_size, f"{s.params:,}",
                     f"{s.params_nonembedding:,}", f"{s.flops_per_token() / 1e6:,.1f}",
                     f"{s.flops_per_token_megatron() / 1e6:,.1f}", f"{floor:.3f}" if floor else "-"])
    print(tabulate(rows, headers=["size", "layers", "d_model", "heads", "seq_len", "vocab", "params",
                                  "N (non-embed)", "MFLOP/token (PaLM)", "MFLOP/token (Megatron)",
                                  "entropy floor (nats)"], tablefmt="github"))
    print("\nPaLM: 6*N + 12*L*d*S; Megatron (causal-halved attention): 6*N + 6*L*d*S; "
          "N = all parameters except the token/position embedding tables (the untied LM head counts).")
    return 0


def register(sub) -> None:
    r = sub.add_parser("report", help="rebuild summary.md, summary.csv and plots from a run's records")
    r.add_argument("dir", type=Path)
    r.set_defaults(fn=cmd_report)
    w = sub.add_parser("workloads", help="print the workload size table")
    w.set_defaults(fn=cmd_workloads)
