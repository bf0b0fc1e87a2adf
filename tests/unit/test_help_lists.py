"""What ``--help`` lists is what the code has: every strategy, precision and activation checkpointing policy; and
small what-if defaults a new user meets first."""

from __future__ import annotations

import pytest

from harness.cli import build_parser, main
from harness.parallel.activation_checkpoint import AC_POLICIES
from harness.parallel.presets import STRATEGIES
from harness.precision import PRECISIONS


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_help_lists_every_strategy_precision_and_policy(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert ", ".join(STRATEGIES) in text
    assert ", ".join(PRECISIONS) in text
    for policy in AC_POLICIES:
        assert policy.removesuffix("2") in text, policy


def test_plan_for_moe_without_sizes_picks_an_moe_size(capsys):
    assert main(["plan", "--arch", "moe", "--device", "h100", "--gpus", "8"]) == 0
    assert "## moe-mixtral-8x7b" in capsys.readouterr().out
