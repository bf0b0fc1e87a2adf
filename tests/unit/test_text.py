"""How numbers and messages print: n/a unless a finite number, an error's first line, degrees."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.text import degrees_label, first_line, fmt_or


@pytest.mark.parametrize("value,spec,missing,shown", [
    (1234.5, ",.1f", "n/a", "1,234.5"),
    (0.0, ".2f", "n/a", "0.00"),
    (np.float64(2.5), "+.1f", "-", "+2.5"),
    (7, "d", "n/a", "7"),
    (None, ".1f", "n/a", "n/a"),
    (math.nan, ".1f", "-", "-"),
    (np.nan, ".3f", "n/a", "n/a"),
    (math.inf, ".1f", "n/a", "n/a"),
    (-math.inf, ".1f", "-", "-"),
    (True, ".1f", "n/a", "n/a"),
    ("12", ".1f", "n/a", "n/a"),
])
def test_fmt_or_formats_only_finite_numbers(value, spec, missing, shown):
    assert fmt_or(value, spec, missing) == shown


def test_first_line_cuts_at_the_line_and_the_limit():
    assert first_line("rank 1 died (SIGKILL)\ntraceback ...") == "rank 1 died (SIGKILL)"
    assert first_line("x" * 100) == "x" * 60
    assert first_line("abcdef", limit=3) == "abc"
    for nothing in (None, "", "  \n", math.nan):
        assert first_line(nothing) == "no error message"


def test_degrees_label_names_the_degrees_above_one():
    assert degrees_label({"dp_replicate": 1, "dp_shard": 4, "pp": 1, "tp": 2}) == "dp_shard=4 x tp=2"
    assert degrees_label({"dp_shard": 1}) == "1 device"
    assert degrees_label(None) == "1 device"


def test_degrees_label_marks_sequence_parallel_on_tp_only():
    # sp is a flag on tp's degree, never a degree of its own, whatever its value
    assert degrees_label({"dp_shard": 2, "tp": 2, "sp": 2}) == "dp_shard=2 x tp=2 (sp)"
    assert degrees_label({"cp": 2, "tp": 1, "sp": 1}) == "cp=2"
    assert degrees_label({"tp": 2, "sp": 0}) == "tp=2"
