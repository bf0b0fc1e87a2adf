"""The claims a record makes, judged by hand (:mod:`harness.run.claims`), and the step's evidence counted by hand
(:mod:`harness.measure.op_tally`). The planted lies run in ``tests/distributed/test_claims_planted.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.measure.op_tally import OpTally
from harness.parallel.activation_checkpoint import MATMULS, apply_ac
from harness.run import claims
from harness.spec import CellConfig

# Two blocks as a Tally holds them: block "0" ran 2 calls of 7 matmuls (every other: 3 a call), its attention's
# core 3 a call; block "1" the same.
BLOCKS = {"0": {"calls": 2, "matmuls": 14, "every_other": 6, "attn_core": 6},
          "1": {"calls": 2, "matmuls": 14, "every_other": 6, "attn_core": 6}}


@pytest.mark.parametrize(("policy", "want"), [
    ("none", 0),
    ("full", 28),     # both blocks whole: 14 + 14
    ("layer2", 14),   # block "1" (the 2nd, counted from 1) whole; block "0" keeps everything
    ("op", 12),       # 6 + 6: the 2nd, 4th and 6th of each call's 7
    ("attn", 12),     # q, k, v of each call: 3 x 2 calls x 2 blocks
])
def test_expected_recompute_by_policy(policy, want):
    assert claims.expected_recompute(policy, BLOCKS) == want


def test_expected_recompute_of_blocks_named_otherwise_goes_by_their_order():
    own = {"inner.a": BLOCKS["0"], "inner.b": {**BLOCKS["1"], "matmuls": 10}}
    assert claims.expected_recompute("layer2", own) == 10  # the 2nd block in order, whole


def _cfg(**kw) -> CellConfig:
    base = dict(size="tiny", strategy="single", precision="fp32", world_size=1, global_batch=8, seq_len=64, steps=2,
                warmup=1, device_kind="cpu")
    return CellConfig.from_dict({**base, **kw})


def _worker(forward=25, backward=70, blocks=None, ops=None, frames=0, **extra) -> dict:
    observed = {"ops": {"forward_matmuls": forward, "backward_matmuls": backward, "blocks": blocks or {},
                        "ops": ops or {}}, "frames_compiled": frames, "fp8": {"recipes": [], "float8_all_gather": []}}
    return {"observed": {"by_rank": [observed]}, "comm_by_rank": [{}], **extra}


def _by_claim(cfg: CellConfig, worker: dict) -> dict[str, dict]:
    return {c["claim"]: c for c in claims.judge(cfg, worker)}


def test_an_honest_checkpointed_cell_holds_every_claim():
    # 25 forward matmuls (4 blocks of 6, the head's 1), full: 24 recomputed; backward 2 x 25 + 24 = 74
    blocks = {str(i): {"calls": 1, "matmuls": 6, "every_other": 3, "attn_core": 3} for i in range(4)}
    judged = claims.judge(_cfg(ac="full"), _worker(backward=74, blocks=blocks))
    assert {c["claim"]: c["status"] for c in judged} == {"layout": "checked", "checkpoint": "checked",
                                                         "ac": "checked", "optimizer": "checked", "compile": "checked"}
    assert claims.contradicted(judged) is None


def test_a_backward_that_recomputed_less_than_the_policy_contradicts_it():
    blocks = {str(i): {"calls": 1, "matmuls": 6, "every_other": 3, "attn_core": 3} for i in range(4)}
    c = _by_claim(_cfg(ac="op"), _worker(backward=58, blocks=blocks))["ac"]  # 58 - 50 = 8 recomputed, op's is 12
    assert c["status"] == "contradicted"
    assert c["compared"] == ("rank 0's backward ran 58 matmuls for 25 in its forward: 8 recomputed, where ac op "
                             "recomputes 12 of what its blocks ran")


def test_a_split_backward_may_recompute_a_whole_multiple_only():
    blocks = {"0": {"calls": 4, "matmuls": 24, "every_other": 12, "attn_core": 12}}
    zb = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule="zb", ac="full")
    worker = {"observed": {"by_rank": [_worker(forward=24, backward=48 + 5 * 24, blocks=blocks)["observed"]["by_rank"][0]]}}
    assert claims._ac(zb, worker["observed"]["by_rank"])["status"] == "checked"
    odd = _worker(forward=24, backward=48 + 30, blocks=blocks)["observed"]["by_rank"]  # 30: not a multiple of 24
    assert claims._ac(zb, odd)["status"] == "contradicted"
    one = _worker(forward=24, backward=48 + 2 * 24, blocks=blocks)["observed"]["by_rank"]
    assert claims._ac(_cfg(ac="full"), one)["status"] == "contradicted"  # twice is a lie without a split backward


@pytest.mark.parametrize(("optimizer", "calls", "status"), [
    ("adamw-fused", 1, "checked"), ("adamw-fused", 0, "contradicted"), ("adamw", 0, "checked"), ("adamw", 2, "contradicted")])
def test_the_fused_kernel_is_the_optimizer_claims_evidence(optimizer, calls, status):
    c = _by_claim(_cfg(optimizer=optimizer), _worker(ops={"fused_adamw": calls} if calls else {}))["optimizer"]
    assert c["status"] == status, c


@pytest.mark.parametrize(("compile_on", "frames", "warm", "status"), [
    (True, 4, 4, "checked"), (True, 0, 0, "contradicted"), (False, 0, None, "checked"), (False, 1, None, "contradicted")])
def test_frames_compiled_are_the_compile_claims_evidence(compile_on, frames, warm, status):
    extra = {"compile": {"frames_compiled": warm}} if warm is not None else {}
    c = _by_claim(_cfg(compile=compile_on), _worker(frames=frames, **extra))["compile"]
    assert c["status"] == status, c


def test_one_device_runs_no_collective():
    assert _by_claim(_cfg(), _worker())["layout"]["status"] == "checked"
    c = _by_claim(_cfg(), {**_worker(), "comm_by_rank": [{"all_reduce": {"calls_per_step": 1, "bytes_per_step": 4}}]})
    assert c["layout"]["status"] == "contradicted"


def test_checkpoints_claimed_need_every_due_save_with_bytes_on_every_rank():
    on = _cfg(checkpoint="sync", steps=5, checkpoint_every=2)  # measured steps 2 and 4 end with a save: 2 due
    good = {"mode": "sync", "saves": 2, "bytes_written_by_rank": [1000]}

    def status(cfg, **ckpt):
        return _by_claim(cfg, _worker(**ckpt))["checkpoint"]["status"]

    assert status(on, checkpoint=good) == "checked"
    assert status(on, checkpoint={**good, "saves": 1}) == "contradicted"  # one due save missing
    assert status(on, checkpoint={**good, "mode": "async"}) == "contradicted"
    assert status(on, checkpoint={**good, "bytes_written_by_rank": [0]}) == "contradicted"
    assert status(on) == "contradicted"  # nothing logged
    resumed = {**good, "saves": 1, "start": {"kind": "resume", "from_step": 2}}
    assert status(on, checkpoint=resumed) == "checked"  # the attempt before made the first
    assert status(on, checkpoint={**resumed, "saves": 3}) == "contradicted"
    assert status(_cfg(), checkpoint=good) == "contradicted"  # off, yet saved


@pytest.mark.parametrize(("routing", "worst", "status"), [
    ("balanced", 1.0, "checked"), ("balanced", 1.5, "contradicted"), ("learned", 1.5, "checked"), ("learned", 1.0, "n/a")])
def test_expert_loads_are_the_routing_claims_evidence(routing, worst, status):
    c = _by_claim(_cfg(arch="moe", moe_routing=routing), _worker(moe={"imbalance_max_over_mean_worst": worst}))
    assert c["moe_routing"]["status"] == status, c


def test_a_record_without_evidence_says_its_ac_cannot_be_checked():
    c = _by_claim(_cfg(ac="full"), {"comm_by_rank": [{}]})["ac"]
    assert c["status"] == "n/a" and "recorded before claims" in c["reason"]


class _Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def core(self, x):
        return self.q(x) * self.k(x)

    def forward(self, x):
        return self.out(self.core(x))


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn, self.fc = _Attn(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(torch.relu(self.attn(x)))


class _Model(nn.Module):
    def __init__(self, d: int = 8, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): _Block(d) for i in range(n)})

    def block_items(self):
        return list(self.blocks.items())

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return x


@pytest.mark.parametrize(("policy", "recomputed"), [("none", 0), ("full", 8), ("op", 4)])
def test_the_tally_counts_a_steps_matmuls_by_hand(policy, recomputed):
    """Two blocks of 4 linears (q, k, out, fc: ``addmm`` with a bias), an input that needs its gradient: forward 8,
    backward 2 x 8 plus what the policy recomputed (early stop off, as the worker's counted step runs it)."""
    torch.manual_seed(0)
    model = _Model()
    apply_ac(model, policy)  # type: ignore[arg-type]  # a block-shaped stand-in for a Decoder
    x = torch.randn(3, 8, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), OpTally(MATMULS, [model]) as mode:
        model(x).sum().backward()
    t = mode.tally
    assert (t.forward_matmuls, t.backward_matmuls) == (8, 16 + recomputed)
    assert {k: (b.calls, b.matmuls, b.every_other, b.attn_core) for k, b in t.blocks.items()} == \
        {"0": (1, 4, 2, 2), "1": (1, 4, 2, 2)}  # attention's q and k, not its out
    assert claims.expected_recompute(policy, {k: vars(b) for k, b in t.blocks.items()}) == recomputed


def test_the_tally_sees_the_fused_adamw_kernel():
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    with OpTally(MATMULS, []) as mode:
        torch.optim.AdamW([p], lr=0.1, fused=True).step()
    assert mode.tally.ops == {"fused_adamw": 1}
