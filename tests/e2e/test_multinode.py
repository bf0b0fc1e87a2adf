"""Two "nodes" on one machine: two ``harness bench`` processes sharing one rendezvous endpoint.

``--gpus`` is per node, so ``--nnodes 2 --gpus 2`` is world size 4. Node 1 starts first on
purpose: it must wait for node 0 (which hosts the rendezvous and holds global rank 0) instead of
taking over, and only node 0 writes records.
"""

from __future__ import annotations

import time

import pytest

GPUS_PER_NODE = 2
STRATEGIES = "ddp"
"""One cell keeps the tier short (4 ranks on a shared 2-core box: ~25-45 s per cell); with more,
the cells run back to back on the same endpoint (checked by hand with ddp,fsdp)."""
FLAGS = ["--nnodes", "2", "--gpus", str(GPUS_PER_NODE), "--strategies", STRATEGIES, "--no-reference",
         "--sizes", "tiny", "--steps", "3", "--warmup", "1", "--batch", "4", "--device", "cpu"]
NODE_TIMEOUT_S = 420


@pytest.mark.e2e
@pytest.mark.slow
def test_two_nodes_share_each_cell_and_node_0_writes_the_records(harness_cli, e2e):
    out = harness_cli.tmp / "run"
    planned = [c.cell_id for c in e2e.planned(*FLAGS) if c.valid]
    assert len(planned) == len(STRATEGIES.split(","))
    common = ["bench", *FLAGS, "--rdzv-endpoint", f"127.0.0.1:{e2e.free_port()}", "--no-calibrate",
              "--cell-timeout", "180", "--out", str(out)]
    node1 = harness_cli.popen(*common, "--node-rank", "1", log="node1")
    time.sleep(2.0)  # node 1 is first at the endpoint
    node0 = harness_cli.popen(*common, "--node-rank", "0", log="node0")
    try:
        rc0 = node0.wait(timeout=NODE_TIMEOUT_S)
        rc1 = node1.wait(timeout=60)
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc0 == 0, harness_cli.stderr("node0")[-3000:] + harness_cli.stdout("node0")[-3000:]
    assert rc1 == 0, harness_cli.stderr("node1")[-3000:] + harness_cli.stdout("node1")[-3000:]

    recs = e2e.read_records(out)
    assert [r["cell_id"] for r in recs] == planned, "one record per cell, written once (by node 0)"
    for r in recs:
        assert r["status"] == "ok", f"{r['cell_id']}: {r['status']}: {r['error']}"
        assert r["config"]["world_size"] == 2 * GPUS_PER_NODE and r["config"]["nnodes"] == 2
        assert len(r["samples"]["step_time_s_per_rank"]) == 2 * GPUS_PER_NODE, "every rank's samples gathered"
        assert (out / "cells" / r["cell_id"] / "result.json").exists(), "global rank 0 runs on node 0"
    assert not (out / "node1" / "records.jsonl").exists()
    assert e2e.survivors(str(out)) == []
