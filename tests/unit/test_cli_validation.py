"""Validation before launch: each bad cell is one stderr line, exit 2, and nothing is written."""

from __future__ import annotations

import pytest

from harness.cli import main
from workloads.sizes import get_size

CASES = {
    "degrees": (["--gpus", "4", "--strategies", "fsdp", "--degrees", "dp_shard=3"],
                "dp_replicate (1) x dp_shard (3) x tp (1) x pp (1) = 3 must equal the world size (4)"),
    "tp-heads": (["--gpus", "3", "--strategies", "tp"], "tp (3) must divide n_heads (4); choose tp in {1, 2, 4}"),
    "pp-layers": (["--gpus", "8", "--strategies", "pp"], "pipeline stages (8 = pp 8 x 1 per rank) exceed layers (4)"),
    "batch": (["--gpus", "2", "--strategies", "ddp", "--batch", "3"],
              "global batch (3) must be divisible by dp (2) x grad_accum (1) = 2"),
    "microbatches": (["--gpus", "4", "--strategies", "pp", "--microbatches", "2"],
                     "schedule 1f1b with pp 4 needs >= 4 microbatches, got 2; raise --microbatches"),
    "size": (["--sizes", "huge"], "unknown gpt2 size 'huge'; choose from tiny"),
    "gpus0": (["--gpus", "0"], "--gpus '0': each value must be an integer >= 1"),
    "gpusx": (["--gpus", "x"], "--gpus 'x': each value must be an integer >= 1"),
    "steps0": (["--steps", "0"], "--steps '0': must be an integer >= 1"),
    "monitor-hz": (["--monitor-hz", "-1"], "--monitor-hz '-1': must be a rate in Hz in [0, 1000]"),
    "rounds0": (["--rounds", "0"], "--rounds '0': must be an integer >= 1"),
    "rounds-nsys": (["--rounds", "3", "--nsys"], "--rounds 3 with --nsys: a capture covers one job per cell"),
    "checkpoint-every0": (["--checkpoint", "sync", "--checkpoint-every", "0"],
                          "--checkpoint-every '0': must be an integer >= 1"),
    "checkpoint-mode": (["--checkpoint", "often"], "--checkpoint 'often': choose from off, sync, async, async-pinned"),
    "checkpoint-pinned-cpu": (["--checkpoint", "sync,async-pinned"],
                              "--checkpoint async-pinned stages a GPU's state in pinned host memory: n/a on CPU ranks"),
    "checkpoint-keep-off": (["--checkpoint-keep"], "--checkpoint-keep keeps saves, and --checkpoint is off"),
    "restore-from-missing": (["--restore-from", "/nonexistent/step-000005"],
                             "--restore-from /nonexistent/step-000005: not a complete harness checkpoint"),
    # Every requested cell invalid: exit 2, though the added single-device reference is valid.
    "only-reference-valid": (["--gpus", "2", "--degrees", "pp=3"],
                             "no valid cell to run: 15 cells (tiny-ddp-fp32-w2-gb8-strong, ...): dp_replicate (1) x "
                             "dp_shard (1) x tp (1) x pp (3) = 3 must equal the world size (2)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_cell_exits_2_with_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    args, message = CASES[case]
    out = tmp_path / "run"
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--out", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and message in err[0], err
    assert not out.exists(), "nothing may be written for bad input"


def test_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--out", str(blocker / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is not writable" in err[0] and "choose a writable directory" in err[0]


@pytest.mark.parametrize("toml,message", [
    ("stpes = 5\n", "unknown key 'stpes' in {f}; did you mean 'steps'?"),
    ("bogus_key = 1\n", "unknown key 'bogus_key' in {f}; valid keys: ac, arch, base_batch,"),
    ('steps = "five"\n', "{f}: steps 'five': must be an integer >= 1"),
    ("gpus = [2, 0]\n", "{f}: gpus '2,0': each value must be an integer >= 1"),
])
def test_sweep_file_is_strict_and_names_its_own_keys(toml, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(toml)
    out = tmp_path / "run"
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--sweep", str(sweep), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message.format(f=sweep) in err[0], err
    assert not out.exists()


def test_sweep_file_keys_and_flags_merge_cli_first(tmp_path, monkeypatch):
    from harness.cli import build_parser
    from harness.cli.args import spec_from_args

    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('steps = 7\nwarmup = 2\nstrategies = ["ddp", "fsdp"]\nlr-rule = "sqrt"\n')
    spec = spec_from_args(build_parser().parse_args(["plan", "--device", "cpu", "--gpus", "2", "--sweep", str(sweep),
                                                     "--steps", "9"]))
    assert (spec.steps, spec.warmup, spec.strategies, spec.lr_rules) == (9, 2, ("ddp", "fsdp"), ("sqrt",))


def _ram(monkeypatch, available_gib: float) -> None:
    """This machine with ``available_gib`` of RAM available (the planner's CPU capacity)."""
    import psutil

    from harness.units import GIB

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=int(available_gib * GIB)))


def test_cell_predicted_over_memory_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """tiny under ddp on 2 ranks needs ~0.4 GiB per rank (the model's peak); give the node 0.5 GiB."""
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    _ram(monkeypatch, 0.5)
    out = tmp_path / "run"
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--gpus", "2", "--strategies", "ddp", "--no-reference",
               "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "GiB per rank > 0.25 GiB available (available RAM / 2 rank(s) on the node)" in err[0], err
    assert "--force to run it anyway" in err[0]
    assert not out.exists()


def test_force_plans_the_cell_the_memory_check_refuses(monkeypatch):
    from harness.cli import build_parser, spec_from_args
    from harness.planner import expand

    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    _ram(monkeypatch, 0.5)
    argv = ["plan", "--device", "cpu", "--gpus", "2", "--strategies", "ddp", "--no-reference"]
    refused = expand(spec_from_args(build_parser().parse_args(argv)))
    forced = expand(spec_from_args(build_parser().parse_args([*argv, "--force"])))
    assert [c.valid for c in refused] == [False] and "predicted" in refused[0].reason
    assert [c.valid for c in forced] == [True] and forced[0].fits is False


def test_workload_calibration_refuses_a_size_that_cannot_fit(monkeypatch):
    from harness.calibration import workload
    from harness.errors import UsageError

    _ram(monkeypatch, 1.0)
    need = workload.need_gib(get_size("small"), 128, "fp32", "cpu", 4)
    assert need > 1.0 and need == pytest.approx(4 * workload.need_gib(get_size("small"), 128, "fp32", "cpu", 1))
    with pytest.raises(UsageError, match=r"workload calibration of small .*needs ~.* GiB, 1 GiB is available"):
        workload.calibrate_workload("cpu", get_size("small"), 128, "fp32", 1, concurrent=4, cache=None, force=True)
