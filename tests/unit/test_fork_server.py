"""The fork server: safe to fork (CUDA never initialised, one thread), and it ends a cell as torchrun does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    """In the environment the sweep gives its fork server (harness.run.fork_client): numpy's BLAS single-threaded."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_importing_the_fork_server_never_initialises_cuda_and_starts_no_thread():
    """Every CUDA entry point made to fail before the import: the parent that forks the ranks must
    never call one (a rank of a forked parent with a CUDA context cannot use its GPU)."""
    r = _python("""
import os, threading, torch
def boom(*a, **k):
    raise AssertionError("CUDA touched during import")
torch.cuda._lazy_init = boom
torch.cuda.init = boom
if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build: the driver's device count inits it too
    torch._C._cuda_getDeviceCount = boom
import harness.run.fork_server as f
assert f.fork_safety_problem() is None
assert not torch.cuda.is_initialized()
print(len(os.listdir("/proc/self/task")), threading.active_count())
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "1"], "the parent must be single-threaded when it forks"


def test_a_known_fork_safe_thread_is_allowed_and_any_other_is_named():
    """The lent H200's image preloads jemalloc with background threads on: `jemalloc_bg_thd` (its purging
    thread, whose locks jemalloc's own atfork handlers hold across a fork) must not stop the server, and
    any other thread must, by name."""
    from harness.run.fork_server import fork_safety_problem, other_threads

    assert fork_safety_problem(["jemalloc_bg_thd"]) is None
    problem = fork_safety_problem(["jemalloc_bg_thd", "pt_autograd_0"])
    assert problem is not None and "1 other threads" in problem and "pt_autograd_0" in problem
    assert "jemalloc_bg_thd" not in problem
    before = other_threads()
    stop = threading.Event()
    th = threading.Thread(target=stop.wait)
    th.start()
    try:
        assert len(other_threads()) == len(before) + 1
    finally:
        stop.set()
        th.join()


def test_one_failed_rank_ends_the_others_and_is_named_the_root():
    r = _python("""
import json, os, signal, time
from harness.run.fork_server import _wait_all
pids = {}
for rank, action in enumerate(["sleep", "fail", "ok"]):
    pid = os.fork()
    if pid == 0:
        if action == "sleep":
            time.sleep(60)
        if action == "fail":
            time.sleep(0.5)  # after the ok rank's exit: a rank still alive at the failure is ended
        os._exit(3 if action == "fail" else 0)
    pids[pid] = rank
t0 = time.monotonic()
exits = _wait_all(pids)
print(json.dumps({"exits": exits, "seconds": time.monotonic() - t0}))
""")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    by_rank = {e["rank"]: e for e in out["exits"]}
    assert by_rank[1] == {"rank": 1, "exitcode": 3, "root": True}
    assert by_rank[0]["exitcode"] == -15 and by_rank[0]["root"] is False, "the sleeping rank gets SIGTERM"
    assert by_rank[2] == {"rank": 2, "exitcode": 0, "root": False}
    assert out["seconds"] < 30, "the sleeper was ended, not waited for"  # a hang guard: 60 s if not ended


RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE")
"""What a rank reads of its place: torchrun sets each (torch.distributed.elastic's worker env), and so must a forked rank."""


def test_a_forked_ranks_environment_is_what_torchrun_gives_the_same_rank(tmp_path):
    """torchrun itself is the reference: 2 ranks dump their environment, and the fork server's rank environment
    (``_rank_env``) must match it field by field for every key that places a rank; ``MASTER_ADDR`` is loopback in
    the fork's (torchrun --standalone names this host's), the port each one's own."""
    from harness.run.fork_server import _rank_env

    dump = tmp_path / "dump.py"
    dump.write_text("import json, os, sys\n"
                    "open(os.path.join(sys.argv[1], os.environ['RANK'] + '.json'), 'w').write(json.dumps(dict(os.environ)))\n")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(dump),
                    str(tmp_path)], check=True, capture_output=True, timeout=120)
    for rank in (0, 1):
        torchrun = json.loads((tmp_path / f"{rank}.json").read_text())
        forked = _rank_env(rank, 2, 29500)
        assert {k: forked[k] for k in RANK_KEYS} == {k: torchrun[k] for k in RANK_KEYS}, rank
        placing = {k for k in torchrun if k.split("_")[0] in ("RANK", "LOCAL", "WORLD", "GROUP", "ROLE")}
        assert placing - set(forked) <= {"ROLE_NAME"}, sorted(placing - set(forked))  # ROLE_NAME: "default", unread
        assert set(forked) - set(torchrun) == set(), sorted(set(forked) - set(torchrun))
        assert forked["MASTER_ADDR"] == "127.0.0.1", forked  # loopback: the harness rendezvous on this host by default


def test_a_forked_ranks_environment_by_hand():
    """Rank 2 of 4 on port 29517, every value written out (torchrun's worker environment for a one-node job:
    the node is group 0 of 1, local rank = rank, role = the whole world), the port the one the leader chose."""
    from harness.run.fork_server import _rank_env

    assert _rank_env(2, 4, 29517) == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "2", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517"}
