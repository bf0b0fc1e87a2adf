"""memory_per_rank.png: what each rank held at its peak, read back from the figure's artists.

Expected numbers are written here by hand from the synthetic records (bytes in MiB, so GiB = MiB / 1024),
never asked of the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from harness.report.figures import memory_figure
from harness.report.frame import memory_rank_frame
from harness.report.plot_files import MEMORY_RANKS_PNG, write_plots
from harness.report.run_frames import RunFrames

MIB = 2**20


def record(cell_id: str, device_kind: str, size: str = "tiny", predicted: dict | None = None,
           **metrics: Any) -> dict[str, Any]:
    """An ok cell record with only what the memory plot reads (docs/records.md)."""
    return {"schema_version": 1, "kind": "cell", "cell_id": cell_id, "status": "ok",
            "config": {"size": size, "device_kind": device_kind}, "metrics": metrics,
            "predicted": predicted or {}}


# three CPU ranks holding different model states (a pipeline's uneven stages) and tensor peaks
CPU_STATES_MIB = [4.0, 2.0, 1.0]
CPU_TENSOR_GIB = [10 / 1024, 7 / 1024, 3 / 1024]
CPU = record("tiny-pp-fp32-w3", "cpu", predicted={"peak_tensor_gib": 11 / 1024},
             peak_mem_gib_per_rank=[0.40, 0.38, 0.37], peak_mem_kind="rss",
             peak_tensor_gib=10 / 1024, peak_tensor_gib_per_rank=CPU_TENSOR_GIB,
             model_state_bytes_by_rank=[int(s * MIB) for s in CPU_STATES_MIB])
# two ranks, only the max over ranks of the tensor bytes recorded
MAX_ONLY = record("tiny-fsdp-fp32-w2", "cpu", peak_mem_gib_per_rank=[0.36, 0.35], peak_mem_kind="rss",
                  peak_tensor_gib=6 / 1024, model_state_bytes_by_rank=[3 * MIB, 2 * MIB])
# GPU: the allocator's peak per rank against capacity = 60 / 75% = 80 GiB
GPU = record("tiny-ddp-bf16-w2", "cuda", peak_mem_gib_per_rank=[60.0, 58.0], peak_mem_gib=60.0,
             peak_mem_kind="cuda_allocated", mem_capacity_pct=75.0,
             model_state_bytes_by_rank=[5 * MIB, 5 * MIB])
# before tensor bytes were recorded: RSS only
OLD = record("tiny-ddp-fp32-w2", "cpu", peak_mem_gib_per_rank=[0.39, 0.34], peak_mem_kind="rss",
             model_state_bytes_by_rank=[14 * MIB, 14 * MIB])


def figure(records: list[dict[str, Any]]) -> Figure:
    fig = memory_figure(memory_rank_frame(records))
    assert fig is not None
    return fig


def title(ax: Axes) -> str:
    """The panel's title on one line (the figure wraps long titles)."""
    return " ".join(ax.get_title().split())


def panel(fig: Figure, words: str) -> Axes:
    (ax,) = [a for a in fig.axes if words in title(a)]
    return ax


def bars(ax: Axes) -> dict[str, BarContainer]:
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def lines(ax: Axes, label: str) -> list[tuple[float, float, float]]:
    """(y, x from, x to) of each segment of the line collection labelled ``label``."""
    (coll,) = [c for c in ax.collections if isinstance(c, LineCollection) and c.get_label() == label]
    return [(seg[0][1], seg[0][0], seg[1][0]) for seg in coll.get_segments()]


def tick_texts(ax: Axes, minor: bool = False) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels(minor=minor)]


def test_cpu_ranks_stack_model_states_under_the_rest_of_their_tensor_peak() -> None:
    ax = panel(figure([CPU]), "live tensor bytes")
    parts = bars(ax)
    states = [p.get_height() for p in parts["model states (exact)"]]
    rest = parts["rest of the tensor peak"]
    assert states == pytest.approx([s / 1024 for s in CPU_STATES_MIB])
    # rest = tensor peak - model states, by hand: 10 - 4, 7 - 2, 3 - 1 MiB
    assert [p.get_height() for p in rest] == pytest.approx([6 / 1024, 5 / 1024, 2 / 1024])
    assert [p.get_y() for p in rest] == pytest.approx(states)
    assert [p.get_y() + p.get_height() for p in rest] == pytest.approx(CPU_TENSOR_GIB)
    assert tick_texts(ax) == ["r0", "r1", "r2"]
    # the cell's label is kept though its tick falls on r1's (odd world size)
    assert ["-".join(t.split("\n")) for t in tick_texts(ax, minor=True)] == ["tiny-pp-fp32-w3"]
    ((y, x0, x1),) = lines(ax, "model: predicted tensor peak (max over ranks)")
    assert y == pytest.approx(11 / 1024)
    assert (x0, x1) == pytest.approx((rest[0].get_x(), rest[2].get_x() + rest[2].get_width()))  # across its ranks
    assert "process base left out" in title(ax) and title(ax).startswith("size tiny")


def test_only_the_max_over_ranks_is_drawn_as_a_line_not_as_a_rank_bar() -> None:
    ax = panel(figure([MAX_ONLY]), "max over ranks")
    assert "per-rank tensor bytes not recorded" in title(ax)
    parts = bars(ax)
    assert list(parts) == ["model states (exact, per rank)"]
    assert [p.get_height() for p in parts["model states (exact, per rank)"]] == pytest.approx([3 / 1024, 2 / 1024])
    assert [y for y, _, _ in lines(ax, "tensor peak, max over ranks")] == pytest.approx([6 / 1024])
    assert tick_texts(ax) == ["r0", "r1"]


def test_gpu_and_old_records_keep_their_recorded_peak_beside_the_tensor_panel() -> None:
    fig = figure([OLD, CPU, GPU])
    assert len(fig.axes) == 3
    gpu = panel(fig, "CUDA allocator")
    assert [p.get_height() for p in bars(gpu)["allocator peak"]] == pytest.approx([60.0, 58.0])
    assert [y for y, _, _ in lines(gpu, "device capacity")] == pytest.approx([80.0])
    assert tick_texts(gpu) == ["r0", "r1"]
    old = panel(fig, "includes the process base")
    assert [p.get_height() for p in bars(old)["RSS peak (with the process base)"]] == pytest.approx([0.39, 0.34])
    assert ["-".join(t.split("\n")) for t in tick_texts(old, minor=True)] == ["tiny-ddp-fp32-w2"]
    assert tick_texts(panel(fig, "live tensor bytes")) == ["r0", "r1", "r2"]


def test_each_size_gets_its_own_panel_and_the_plain_rank_frame_still_plots() -> None:
    mini = record("mini-pp-fp32-w3", "cpu", size="mini", **{**CPU["metrics"]})
    fig = figure([CPU, mini])
    assert sorted(title(a).split(":")[0] for a in fig.axes) == ["size mini", "size tiny"]
    plain = memory_figure(memory_rank_frame([OLD, GPU]))  # no tensor bytes in either: the recorded peaks
    assert plain is not None and len(plain.axes) == 2


def test_report_writes_the_memory_plot_for_a_mixed_run(tmp_path: Path) -> None:
    written = write_plots(RunFrames.of([CPU, MAX_ONLY, GPU, OLD]), tmp_path)
    assert tmp_path / MEMORY_RANKS_PNG in written
    assert (tmp_path / MEMORY_RANKS_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
