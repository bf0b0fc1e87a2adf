"""``harness fit`` as text: the fake-collectives banner and the per-role table (formatting only)."""

from __future__ import annotations

from tabulate import tabulate

from harness.text import degrees_label
from harness.units import MIB

BANNER = ("FIT: collectives are FAKE (torch's fake process group: they return at once), so no time or "
          "throughput is reported; memory is measured on this device as one rank of N.")


def _gib(x: float | None) -> str:
    """Two decimals, or 3 significant digits below 1 GiB (the CPU sizes); n/a where not priced (a module of your
    own's peak)."""
    if x is None:
        return "n/a"
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _err(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f}%"


def fit_table(records: list[dict]) -> str:
    """One row per rank role: measured peak and model states, the model's value and error beside each."""
    rows = []
    for r in records:
        c, m = r["config"], r["metrics"]
        ac = f" ac-{c['ac']}" if c.get("ac", "none") != "none" else ""
        head = [f"{c['size']} {c['strategy']} {c['precision']}{ac}", c["world_size"], degrees_label(c.get("degrees")),
                f"{c['micro_batch']} / {c['global_batch']}"]
        for role in m.get("roles", []):
            pred_state = role["predicted_model_state_bytes"] / MIB
            if "peak_mem_gib" in role:
                state = role["model_state_bytes"] / MIB
                state_cell = f"{state:,.1f}" + ("" if role["model_state_exact"] else " (!)")
                peak = _gib(role["peak_mem_gib"])
                fits = "yes" if role["fits"] else "NO"
            else:
                state_cell, peak, fits = "-", "-", "NO (oom)" if role["status"] == "oom" else role["status"]
            rows.append(head + [role["role"], role["ranks"], state_cell, f"{pred_state:,.1f}", peak,
                                _gib(role["predicted_peak_mem_gib"]), _err(role.get("peak_error_pct")), fits])
            head = ["", "", "", ""]
        if "batch_search" in m:
            s = m["batch_search"]
            tried = ", ".join(f"{k}: {'fits' if v else 'no'}" for k, v in s["tried"].items())
            rows.append(["", "", "", "", f"batch auto: largest fitting micro-batch "
                         f"{s['largest_fitting_micro_batch']} (tried {tried})", "", "", "", "", "", "", ""])
    budget = {r["metrics"]["device_mem_gib"] for r in records}
    table = tabulate(rows, headers=["cell", "N", "degrees", "micro / global batch", "role", "ranks",
                                    "model states MiB", "model MiB", "peak GiB", "model peak GiB", "peak error",
                                    f"fits {'/'.join(f'{b:.3g}' for b in sorted(budget))} GiB"],
                     tablefmt="github", disable_numparse=True)
    return table


def legend(records: list[dict]) -> str:
    kinds = sorted({r["metrics"].get("peak_mem_kind") or "?" for r in records})
    compute = sorted({r["metrics"].get("compute") or "?" for r in records})
    return (f"peak: {', '.join(kinds)} (tensor_bytes: bytes of live tensor storages, the CPU analogue of the CUDA "
            f"allocator's max_memory_allocated); compute: {', '.join(compute)} (fake: FakeTensorMode, every "
            f"allocation at its real shape, no arithmetic); model: harness/model/memory.py with no process base; "
            f"peak error = (model - measured) / measured; model states must match exactly ((!) marks a mismatch)")
