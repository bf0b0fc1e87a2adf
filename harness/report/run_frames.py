"""Every frame a run's report reads, built once from its records.

``summary.md``, ``report.html`` and the plots read the same cells, model, composition and lever
frames; :meth:`RunFrames.of` builds each once per report, and the writers take them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.report.composition import composition_frame, top_ops_frame
from harness.report.frame import cells_frame, memory_rank_frame
from harness.report.lever_gains import lever_frame
from harness.report.load_table import expert_load_frame
from harness.report.model_attribution import memory_attribution, step_attribution
from harness.report.model_error import model_frame
from harness.report.pipeline_bubble import bubble_frame
from harness.report.stage_actions import actions_frame


@dataclass(frozen=True)
class RunFrames:
    records: Sequence[dict[str, Any]]
    """The records the frames were built from (the loss curves read them directly)."""
    cells: pd.DataFrame
    """One row per cell (:func:`~harness.report.frame.cells_frame`)."""
    model: pd.DataFrame
    """Predicted against measured (:func:`~harness.report.model_error.model_frame`)."""
    step_attribution: pd.DataFrame
    memory_attribution: pd.DataFrame
    composition: pd.DataFrame
    top_ops: pd.DataFrame
    memory_ranks: pd.DataFrame
    levers: pd.DataFrame
    expert_load: pd.DataFrame
    pipeline_bubble: pd.DataFrame
    """Simulated against measured bubble per pipelined cell (:func:`~harness.report.pipeline_bubble.bubble_frame`)."""
    stage_actions: pd.DataFrame
    """Each pipeline rank's step split into its stage actions (:func:`~harness.report.stage_actions.actions_frame`)."""

    @classmethod
    def of(cls, records: Sequence[dict[str, Any]]) -> RunFrames:
        return cls(records=records, cells=cells_frame(records), model=model_frame(records),
                   step_attribution=step_attribution(records), memory_attribution=memory_attribution(records),
                   composition=composition_frame(records), top_ops=top_ops_frame(records),
                   memory_ranks=memory_rank_frame(records), levers=lever_frame(records),
                   expert_load=expert_load_frame(records), pipeline_bubble=bubble_frame(records),
                   stage_actions=actions_frame(records))
