"""``harness slurm``: the sbatch script is valid bash and hands every node the right bench flags.

The script is also run for real, under stand-ins for ``scontrol``, ``srun`` and ``harness``: each
fake task records the argv it received, which must parse as ``harness bench`` flags describing
the same sweep, with the task's own node rank and the first node's rendezvous endpoint.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest

from harness import cli
from harness.cli import slurm
from harness.cli.args import sweep_arg_values
from harness.errors import UsageError
from harness.records.reader import RECORDS_FILENAME
from harness.run.rundir import save_sweep_args

NODES = ("gpu-a17", "gpu-b02")
JOB_ID = 4242
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST (a long list, a big allocation, outlives `head -n 1`: SIGPIPE);
# show node -o NAME (NodeAddr only where FAKE_NODE_ADDR is set); requeue ID (logged).
case "$1 $2" in
  "show hostnames") printf '%s\\n' {nodes}; seq -f 'gpu-z%g' 1 200000 ;;
  "show node") [ -n "${{FAKE_NODE_ADDR:-}}" ] || exit 1
               echo "NodeName=$4 Arch=x86_64 CoresPerSocket=64 NodeAddr=$FAKE_NODE_ADDR NodeHostName=$4 Port=0" ;;
  "requeue "*) echo "$2" >> "$FAKE_OUT/requeued" ;;
  *) exit 64 ;;
esac
"""
FAKE_SRUN = """#!/bin/bash
# One task per node, like srun --ntasks-per-node=1; each with its own SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
"""
FAKE_HARNESS = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_OUT/argv-$SLURM_NODEID"
exit "${FAKE_RC:-0}"
"""


def _parser() -> argparse.ArgumentParser:
    """The CLI parser with ``slurm`` (registered here too until cli.build_parser calls slurm.register)."""
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    if "slurm" not in sub.choices:
        slurm.register(sub)
    return ap


def _generate(argv: list[str], capsys) -> str:
    args = _parser().parse_args(["slurm", *argv])
    assert args.fn(args) == 0
    return capsys.readouterr().out


SWEEP = ["--nnodes", "2", "--gpus", "4", "--strategies", "ddp,fsdp+tp", "--sizes", "tiny", "--precision", "fp32",
         "--steps", "7", "--no-reference"]


def test_script_is_valid_bash_with_the_sbatch_header(tmp_path, capsys):
    out = tmp_path / "run dir"  # a space: quoting must hold
    script = _generate([*SWEEP, "--time", "02:30:00", "--partition", "gpu", "--out", str(out)], capsys)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=harness-sweep", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=4", "#SBATCH --time=02:30:00", "#SBATCH --partition=gpu",
                      f'#SBATCH --output="{out}/slurm-%j.out"', "#SBATCH --open-mode=append",
                      "#SBATCH --signal=TERM@120", "#SBATCH --requeue"]
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    for arg in ('--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"', '--rdzv-endpoint "${head_addr}:${port}"',
                "harness bench", "--gpus 4", "--strategies ddp,fsdp+tp", "--or-resume"):
        assert arg in srun[0], f"{arg!r} missing from {srun[0]!r}"
    assert out.is_dir(), "sbatch needs the --output directory to exist"
    assert (out / slurm.SCRIPT_NAME).read_text() == script, "the run directory keeps the script to resubmit"


def _run_fake(tmp_path, script: str, **env_extra: str) -> subprocess.CompletedProcess:
    """The script under stand-ins for scontrol, srun and harness (tmp_path/argv-N: each task's argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL.format(nodes=" ".join(NODES))), ("srun", FAKE_SRUN),
                       ("harness", FAKE_HARNESS)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_OUT": str(tmp_path), "SLURM_JOB_NODELIST": "gpu-[a17,b02]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": str(JOB_ID), "SLURM_NODEID": "0", **env_extra}
    return subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True,
                          timeout=60)


def _task_args(tmp_path, node: int) -> argparse.Namespace:
    argv = (tmp_path / f"argv-{node}").read_bytes().split(b"\0")[:-1]
    return _parser().parse_args([a.decode() for a in argv])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_each_node_gets_its_rank_and_the_first_nodes_endpoint(tmp_path, capsys):
    out = tmp_path / "run dir"
    script = _generate([*SWEEP, "--out", str(out)], capsys)
    run = _run_fake(tmp_path, script)
    assert run.returncode == 0, run.stderr

    original = cli.spec_from_args(_parser().parse_args(["slurm", *SWEEP]))
    port = slurm.PORT_BASE + JOB_ID % slurm.PORT_SPAN
    for node in range(2):
        bench = _task_args(tmp_path, node)
        assert bench.cmd == "bench"
        assert bench.node_rank == node, "$SLURM_NODEID must expand in each task, not in the batch shell"
        assert bench.rdzv_endpoint == f"{NODES[0]}:{port}", "no NodeAddr from scontrol: the node's name"
        assert bench.out == out.resolve() and bench.or_resume, "a requeued job finishes its own run directory"
        assert cli.spec_from_args(bench) == original, "every node must plan the sweep that was validated"
    assert not (tmp_path / "requeued").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_rendezvous_is_at_the_first_nodes_slurm_address(tmp_path, capsys):
    script = _generate([*SWEEP, "--out", str(tmp_path / "run")], capsys)
    run = _run_fake(tmp_path, script, FAKE_NODE_ADDR="10.7.0.17")
    assert run.returncode == 0, run.stderr
    port = slurm.PORT_BASE + JOB_ID % slurm.PORT_SPAN
    assert {_task_args(tmp_path, n).rdzv_endpoint for n in range(2)} == {f"10.7.0.17:{port}"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("rc,restarts,requeued", [(143, "0", True), (143, "2", True), (143, "3", False),
                                                  (1, "0", False), (2, "0", False), (0, "0", False)])
def test_a_sweep_ended_by_sigterm_requeues_its_job_up_to_max_restarts(tmp_path, capsys, rc, restarts, requeued):
    script = _generate([*SWEEP, "--max-restarts", "3", "--out", str(tmp_path / "run")], capsys)
    run = _run_fake(tmp_path, script, FAKE_RC=str(rc), SLURM_RESTART_COUNT=restarts)
    assert run.returncode == rc, "the job's exit code is the harness's"
    assert (tmp_path / "requeued").exists() == requeued
    if requeued:
        assert (tmp_path / "requeued").read_text().split() == [str(JOB_ID)]
        assert f"requeueing (restart {int(restarts) + 1} of 3)" in run.stdout
    elif rc == 143:
        assert f"after 3 restarts; resubmit to finish the sweep: sbatch {tmp_path / 'run'}/job.sbatch" in run.stderr
    assert f"harness job {JOB_ID}: attempt {int(restarts) + 1} on gpu-[a17,b02]" in run.stdout


@pytest.mark.parametrize("value,seconds", [("90", 5400), ("5:30", 330), ("01:30:00", 5400), ("2-0", 172800),
                                           ("1-12:30", 131400), ("1-00:00:10", 86410), ("UNLIMITED", None)])
def test_time_limits_in_seconds(value, seconds):
    assert slurm.time_limit_s(value) == seconds


def test_submit_prints_the_job_the_run_directory_and_how_to_follow(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\n[ "$1" = --parsable ] && [ -f "$2" ] && echo "777;cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    out = tmp_path / "run"
    text = _generate([*SWEEP, "--out", str(out), "--submit"], capsys)
    assert text.splitlines() == [
        f"submitted job 777: run directory {out}",
        f"follow:  tail -f {out}/slurm-777.out   (squeue -j 777; harness report {out} reads the records written "
        f"so far)",
        f"again:   sbatch {out}/job.sbatch finishes the same sweep after a cancel or a time limit"]
    assert (out / "job.sbatch").read_text().startswith("#!/bin/bash")


def test_submit_without_sbatch_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    out = tmp_path / "run"
    args = _parser().parse_args(["slurm", *SWEEP, "--out", str(out), "--submit"])
    with pytest.raises(UsageError, match="--submit: no sbatch on PATH"):
        args.fn(args)
    assert not out.exists()


def test_a_directory_holding_another_sweep_is_refused_and_its_own_sweep_accepted(tmp_path, capsys):
    out = tmp_path / "run"
    bench = _parser().parse_args(["bench", *SWEEP, "--out", str(out)])
    save_sweep_args(out.resolve(), sweep_arg_values(bench))  # as node 0's `harness bench` in the job records it
    (out / RECORDS_FILENAME).write_text('{"kind": "calibration"}\n')
    assert "#SBATCH --requeue" in _generate([*SWEEP, "--out", str(out)], capsys), "resubmitting the same sweep"
    args = _parser().parse_args(["slurm", *SWEEP, "--sizes", "mini", "--out", str(out)])
    with pytest.raises(UsageError, match=r"holds a different sweep \(--sizes 'tiny' there, 'mini' here\)"):
        args.fn(args)


def test_cpu_cluster_requests_no_gpus(tmp_path, capsys):
    script = _generate(["--device", "cpu", "--gpus", "2", "--out", str(tmp_path / "r")], capsys)
    assert "--gpus-per-node" not in script
    assert "--device cpu" in script


@pytest.mark.parametrize("argv,named", [
    (["--gpus", "0"], "--gpus"),
    (["--steps", "0"], "--steps"),
    (["--sizes", "huge"], "huge"),
    (["--time", "2h"], "--time"),
    (["--partition", "gpu; rm -rf /"], "--partition"),
    (["--nnodes", "0"], "--nnodes"),
    (["--time", "2", "--warn-before", "120"], "--warn-before"),
    (["--warn-before", "0"], "--warn-before"),
    (["--max-restarts", "-1"], "--max-restarts"),
])
def test_bad_input_is_a_usage_error_before_any_script_or_directory(argv, named, tmp_path, capsys):
    out = tmp_path / "run"
    args = _parser().parse_args(["slurm", *argv, "--out", str(out)])
    with pytest.raises(UsageError, match=named.replace("-", r"\-")):
        args.fn(args)
    assert capsys.readouterr().out == ""
    assert not out.exists()


def test_script_function_quotes_flags_for_the_task_shell():
    script = slurm.slurm_script(["--sweep", "/a b/s.toml", "--strategies", "ddp"], slurm.SlurmJob(3, 8, "90"),
                                "/runs/x")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --gpus-per-node=8" in script and "--partition" not in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    inner = subprocess.run(["bash", "-c", 'printf "%s" ' + srun.split("bash -c ", 1)[1]], capture_output=True,
                           text=True, timeout=30).stdout
    assert inner.startswith("exec harness bench --sweep '/a b/s.toml' --strategies ddp --nnodes \"$SLURM_NNODES\"")


def test_cli_has_the_slurm_subcommand():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "slurm" in sub.choices, "harness/cli.py build_parser must call harness.cli.slurm.register(sub)"


def test_every_flag_the_user_gives_reaches_each_nodes_bench_command(tmp_path):
    """Every sweep and run flag ``harness slurm`` takes, each set to a value that is not its default, is in the
    script's ``harness bench`` line with that value (a flag forgotten by ``sweep_flags`` would silently run the
    default on the cluster). The values are markers, not a valid sweep: the line is built before any planning."""
    import shlex

    from harness.cli import build_parser
    from harness.cli.args import actions_of, sweep_actions
    from harness.cli.bench import add_run_args
    from harness.cli.slurm import SlurmJob, slurm_script, sweep_flags

    sweep_file = tmp_path / "sweep.toml"
    argv, expected = [], []
    for action in [*sweep_actions(), *actions_of(add_run_args)]:
        option = action.option_strings[0]
        if action.dest == "nnodes":  # the script passes Slurm's own ($SLURM_NNODES)
            continue
        if action.nargs == 0:
            argv.append(option)
            expected.append((option, None))
            continue
        if action.dest == "sweep":
            value = str(sweep_file)
        elif action.choices:
            value = next(c for c in action.choices if c != action.default)
        elif action.type is float:
            value = "7.5"
        else:
            value = f"v-{action.dest}"
        argv += [option, value]
        expected.append((option, value))
    args = build_parser().parse_args(["slurm", *argv])
    script = slurm_script(sweep_flags(args), SlurmJob(nnodes=2, gpus_per_node=0), str(tmp_path / "run"))
    [line] = [ln for ln in script.splitlines() if "harness bench" in ln]
    outer = shlex.split(line)  # srun ... bash -c 'exec harness bench ...' || rc=$?
    words = shlex.split(outer[outer.index("-c") + 1])  # the task's own words, as its bash reads them
    for option, value in expected:
        assert option in words, f"{option} does not reach the nodes' bench"
        if value is not None:
            assert words[words.index(option) + 1] == value, (option, value, words[words.index(option) + 1])
    assert words.count("--nnodes") == 1 and words[words.index("--nnodes") + 1] == "$SLURM_NNODES"
