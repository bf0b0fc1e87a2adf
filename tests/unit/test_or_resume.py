"""``bench --out DIR --or-resume``: what a requeued scheduler job runs. It starts DIR, or finishes
it when DIR holds this same sweep, and never mixes another sweep into it (checked without a run)."""

from __future__ import annotations

import pytest

from harness import cli
from harness.cli import bench
from harness.cli.args import sweep_arg_values
from harness.errors import UsageError
from harness.records.reader import RECORDS_FILENAME
from harness.run.rundir import SWEEP_ARGS_FILE, save_sweep_args

SWEEP = ["--device", "cpu", "--gpus", "2", "--sizes", "tiny", "--strategies", "ddp,fsdp", "--steps", "5"]


def _args(out, *extra: str):
    return cli.build_parser().parse_args(["bench", *SWEEP, *extra, "--out", str(out), "--or-resume"])


def _started(out, *flags: str) -> None:
    """A run directory as `harness bench` leaves it after its first record."""
    out.mkdir(parents=True, exist_ok=True)
    save_sweep_args(out, sweep_arg_values(cli.build_parser().parse_args(["bench", *SWEEP, *flags])))
    (out / RECORDS_FILENAME).write_text('{"kind": "calibration", "run_id": "r1"}\n')


def test_an_empty_or_new_directory_is_started(tmp_path):
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
            (out / RECORDS_FILENAME).write_text("")
        args = _args(out)
        bench._or_resume(args)
        assert args.resume is None


def test_a_directory_holding_the_same_sweep_is_finished(tmp_path, capsys):
    out = tmp_path / "run"
    _started(out)
    args = _args(out)
    bench._or_resume(args)
    assert args.resume == out
    assert f"--or-resume: {out} holds this sweep's records; finishing it" in capsys.readouterr().out


@pytest.mark.parametrize("flags,named", [(["--steps", "9"], "--steps '5' there, '9' here"),
                                         (["--no-reference"], "--no-reference unset there, True here"),
                                         (["--precision", "bf16"], "--precision unset there, 'bf16' here")])
def test_a_directory_holding_another_sweep_is_refused_naming_the_flags(tmp_path, flags, named):
    out = tmp_path / "run"
    _started(out)
    args = _args(out, *flags)
    with pytest.raises(UsageError, match="holds a different sweep") as e:
        bench._or_resume(args)
    assert named in str(e.value) and f"--resume {out}" in str(e.value)
    assert args.resume is None


def test_records_without_recorded_flags_are_refused(tmp_path):
    out = tmp_path / "run"
    _started(out)
    (out / SWEEP_ARGS_FILE).unlink()
    with pytest.raises(UsageError, match="without recorded sweep flags"):
        bench._or_resume(_args(out))


def test_or_resume_needs_out_and_not_resume(tmp_path):
    args = cli.build_parser().parse_args(["bench", *SWEEP, "--or-resume"])
    with pytest.raises(UsageError, match="--or-resume needs --out DIR"):
        bench._or_resume(args)
    args = cli.build_parser().parse_args(["bench", *SWEEP, "--resume", str(tmp_path), "--or-resume"])
    with pytest.raises(UsageError, match="drop --or-resume"):
        bench._or_resume(args)


def test_the_cli_refuses_another_sweep_with_exit_2_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    _started(out, "--steps", "9")
    before = sorted(p.name for p in out.iterdir())
    assert cli.main(["bench", *SWEEP, "--no-calibrate", "--out", str(out), "--or-resume"]) == 2
    assert "holds a different sweep (--steps '9' there, '5' here)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
