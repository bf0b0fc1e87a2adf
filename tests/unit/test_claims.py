"""The claims a record makes, judged by hand (:mod:`harness.run.claims`), and the step's evidence counted by hand
(:mod:`harness.measure.op_tally`). The planted lies run in ``tests/distributed/test_claims_planted.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.measure.op_tally import OpTally
from harness.parallel.activation_checkpoint import MATMULS, apply_ac
from harness.precision import fp8_observed
from harness.run import claims
from harness.spec import CellConfig

REPO = Path(__file__).resolve().parents[2]

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


def _worker(forward=25, backward=70, blocks=None, ops=None, frames=0, params=867_072, **extra) -> dict:
    """One rank's evidence; ``params``: the model it built (by default gpt2 tiny's at :func:`_cfg`'s 64 positions:
    875,264 - 64 x 128 = 867,072)."""
    observed = {"ops": {"forward_matmuls": forward, "backward_matmuls": backward, "blocks": blocks or {},
                        "ops": ops or {}}, "frames_compiled": frames, "fp8": {"recipes": [], "float8_all_gather": []},
                "params_built": params}
    return {"observed": {"by_rank": [observed]}, "comm_by_rank": [{}], **extra}


def _by_claim(cfg: CellConfig, worker: dict) -> dict[str, dict]:
    return {c["claim"]: c for c in claims.judge(cfg, worker)}


def test_an_honest_checkpointed_cell_holds_every_claim():
    # 25 forward matmuls (4 blocks of 6, the head's 1), full: 24 recomputed; backward 2 x 25 + 24 = 74
    blocks = {str(i): {"calls": 1, "matmuls": 6, "every_other": 3, "attn_core": 3} for i in range(4)}
    judged = claims.judge(_cfg(ac="full"), _worker(backward=74, blocks=blocks))
    assert {c["claim"]: c["status"] for c in judged} == {"layout": "checked", "checkpoint": "checked",
                                                         "ac": "checked", "optimizer": "checked", "compile": "checked",
                                                         "model": "checked"}
    assert claims.contradicted(judged) is None


def test_a_backward_that_recomputed_less_than_the_policy_contradicts_it():
    blocks = {str(i): {"calls": 1, "matmuls": 6, "every_other": 3, "attn_core": 3} for i in range(4)}
    c = _by_claim(_cfg(ac="op"), _worker(backward=58, blocks=blocks))["ac"]  # 58 - 50 = 8 recomputed, op's is 12
    assert c["status"] == "contradicted"
    assert c["compared"] == ("rank 0's backward ran 58 matmuls for 25 in its forward: 8 recomputed, where ac op "
                             "recomputes 12 of what its blocks ran")


def test_a_split_backward_recomputes_as_many_times_as_its_passes_unpack_each_block():
    # gpt2 tiny, zb at 2 ranks: rank 0 holds blocks 0 (stage 0: one full backward, once) and 2 (stage 2: the input
    # pass and 8 weight groups, 9 times); rank 1 blocks 1 and 3, 9 times each. 24 matmuls a block: 240 and 432
    # recomputed, the 5x and 9x measured (results/reference/pp-split-recompute-cpu-tiny-w2)
    block = {"calls": 4, "matmuls": 24, "every_other": 12, "attn_core": 12}
    zb = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule="zb", ac="full")

    def rank(blocks: dict, recomputed: int) -> list[dict]:
        forward = 24 * len(blocks)
        return _worker(forward=forward, backward=2 * forward + recomputed, blocks=blocks)["observed"]["by_rank"]

    r0, r1 = {"0": block, "2": block}, {"1": block, "3": block}
    c = claims._ac(zb, rank(r0, 240) + rank(r1, 432))
    assert c["status"] == "checked" and "recomputed [5.0, 9.0] times the policy's by rank, as many as" in c["compared"]
    for wrong in (48, 96, 480):  # once per block, twice, and 10x on the first stage too: each a lie now
        c = claims._ac(zb, rank(r0, wrong) + rank(r1, 432))
        assert c["status"] == "contradicted" and "recomputes 240 of what its blocks ran (its split backward's " \
            "passes counted)" in c["compared"], c
    one = _worker(forward=24, backward=48 + 2 * 24, blocks={"0": block})["observed"]["by_rank"]
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


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="n/a: torchao is not installed (pip install '.[fp8]'; make setup installs it)")
@pytest.mark.parametrize(("recipe", "all_gather"), [("tensorwise", False), ("tensorwise", True), ("rowwise", False),
                                                    ("rowwise_with_gw_hp", False)])
def test_the_float8_linears_say_which_recipe_built_them(recipe, all_gather):
    from dataclasses import replace  # noqa: PLC0415

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 8))
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True,
                     enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "2")
    assert fp8_observed([model]) == {"recipes": [recipe], "float8_all_gather": [all_gather]}
    assert fp8_observed([nn.Linear(4, 4)]) == {"recipes": [], "float8_all_gather": []}


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="n/a: torchao is not installed (pip install '.[fp8]'; make setup installs it)")
def test_a_float8_config_no_recipe_gives_is_unknown():
    from dataclasses import replace  # noqa: PLC0415

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    rowwise, tensorwise = (Float8LinearConfig.from_recipe_name(r) for r in ("rowwise", "tensorwise"))
    mixed = replace(rowwise, cast_config_weight=tensorwise.cast_config_weight, emulate=True)
    model = nn.Sequential(nn.Linear(16, 32))
    convert_to_float8_training(model, config=mixed)
    assert fp8_observed([model])["recipes"] == ["unknown"]


def test_the_layout_claim_names_every_lever_its_collectives_vouch_for():
    fp8 = _cfg(strategy="fsdp+tp", world_size=4, precision="fp8", fp8_emulate=True, fp8_all_gather=True)
    assert claims.layout_levers(fp8) == ["fsdp+tp (dp_replicate 1, dp_shard 2, tp 2, pp 1, sp 1)",
                                         "sequence parallel on", "loss parallel on", "float8 all-gather on"]
    assert claims.layout_levers(_cfg(strategy="pp", world_size=2, microbatches=4)) == \
        ["pp (dp_replicate 1, dp_shard 1, tp 1, pp 2)", "4 microbatches"]
    assert claims.layout_levers(_cfg(strategy="tp", world_size=2)) == \
        ["tp (dp_replicate 1, dp_shard 1, tp 2, pp 1)", "sequence parallel off", "loss parallel off"]
    assert claims.layout_levers(_cfg(strategy="fsdp", world_size=2, precision="fp8", fp8_emulate=True)) == \
        ["fsdp (dp_replicate 1, dp_shard 2, tp 1, pp 1)", "float8 all-gather off"]


# tp over 2 ranks (no sequence parallel), gpt2 tiny at 8 x 64, as the comm counter counted it on the honest cell and
# the model has it: the logits gathered once (512 tokens x 256 vocab x 4 B = 524,288 B) and 25 all-reduces of the
# residual stream (512 x 128 x 4 B = 262,144 B each)
TP2 = [{"all_gather": {"calls_per_step": 1, "bytes_per_step": 524288},
        "all_reduce": {"calls_per_step": 25, "bytes_per_step": 6553600}}] * 2


def test_the_layout_claim_holds_every_ranks_collectives_to_the_models():
    tp = _cfg(strategy="tp", world_size=2, sequence_parallel=False)
    ok = claims._layout(tp, {"comm_by_rank": [dict(r) for r in TP2]})
    assert ok["status"] == "checked" and ok["compared"] == ("every rank's collectives (calls and bytes per kind) "
                                                            "equal the model's for this layout")
    off = [TP2[0], {**TP2[1], "all_reduce": {"calls_per_step": 25, "bytes_per_step": 6553601}}]
    bad = claims._layout(tp, {"comm_by_rank": off})
    assert bad["status"] == "contradicted"
    assert bad["compared"] == ("rank 1's all_reduce: counted 25 call(s), 6,553,601 bytes; the model 25, 6,553,600")
    sp = claims._layout(_cfg(strategy="tp-sp", world_size=2), {"comm_by_rank": TP2})  # sp: gathers and scatters
    assert sp["status"] == "contradicted" and sp["compared"].startswith("rank 0's all_gather: counted 1 call(s)")
    assert claims._layout(tp, {"comm_by_rank": TP2[:1]})["compared"] == "1 rank(s) counted, the model has 2"
    missing = claims._layout(tp, {})
    assert missing["status"] == "n/a" and missing["reason"] == "n/a: the record has no collectives counted per rank"


def _pipeline(*actions) -> dict:
    return {"pipeline": {"actions_ms_by_rank": list(actions)}}


WHOLE = {"forward": 1.0, "backward": 2.0, "backward_input": 0.0, "backward_weight": 0.0}
SPLIT = {"forward": 1.0, "backward": 0.0, "backward_input": 1.0, "backward_weight": 1.0}


@pytest.mark.parametrize(("schedule", "actions", "status"), [
    ("zb", (SPLIT, SPLIT), "checked"), ("zb", (SPLIT, WHOLE), "contradicted"), ("1f1b", (WHOLE, WHOLE), "checked"),
    ("interleaved1f1b", (WHOLE, SPLIT), "contradicted"), ("gpipe", ({**WHOLE, "backward": 0.0}, WHOLE), "contradicted")])
def test_the_schedule_claim_reads_the_stage_actions(schedule, actions, status):
    c = claims._schedule(_cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule=schedule), _pipeline(*actions))
    assert c["status"] == status, c


def test_the_schedule_claim_says_what_it_compared_and_why_a_gpu_cannot():
    zb = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule="zb")
    c = claims._schedule(zb, _pipeline(SPLIT, WHOLE))
    assert c["compared"] == ("the stage actions each rank timed: a split backward (input, then weight) on ranks [0], "
                             "a whole backward on [1]; zb splits every rank's backward (gpipe and 1f1b differ in "
                             "order only, which the clock does not keep)")
    gpu = claims._schedule(zb, {"pipeline": {"actions_ms_by_rank": None}})
    assert gpu["status"] == "n/a" and gpu["reason"].startswith("n/a: the stage actions are timed on CPU ranks only")
    assert claims._schedule(zb, _pipeline(SPLIT, None))["status"] == "n/a"


def _fp8_seen(recipes, gathers) -> list[dict]:
    return [{"fp8": {"recipes": recipes, "float8_all_gather": gathers}}]


@pytest.mark.parametrize(("recipes", "gathers", "status"), [
    (["rowwise"], [False], "checked"), (["tensorwise"], [False], "contradicted"), (["rowwise"], [True], "contradicted"),
    (["rowwise", "tensorwise"], [False], "contradicted"), ([], [], "contradicted")])
def test_the_fp8_claim_reads_the_linears_configs(recipes, gathers, status):
    cfg = _cfg(precision="fp8", fp8_emulate=True, fp8_recipe="rowwise")
    c = claims._fp8(cfg, _fp8_seen(recipes, gathers))
    assert c["status"] == status, c
    assert c["value"] == {"recipe": "rowwise", "float8_all_gather": False}


def test_the_fp8_claim_says_what_the_linears_carried():
    c = claims._fp8(_cfg(precision="fp8", fp8_emulate=True), _fp8_seen([], []))
    assert c["compared"] == "the float8 linears' configs on every rank: recipe(s) none, float8 all-gather none"


def test_each_claim_says_what_it_compared():
    blocks = {str(i): {"calls": 1, "matmuls": 6, "every_other": 3, "attn_core": 3} for i in range(4)}
    by = _by_claim(_cfg(ac="full", optimizer="adamw-fused", compile=True),
                   _worker(backward=74, blocks=blocks, ops={"fused_adamw": 1}, frames=5, compile={"frames_compiled": 4}))
    assert by["ac"]["compared"] == ("matmuls recomputed on the counted step equal the policy's on every rank "
                                    "(rank 0: 24 of 25 forward)")
    assert by["optimizer"]["compared"] == ("torch's fused AdamW kernel (aten._fused_adamw_) dispatched [1] time(s) by "
                                           "rank on the counted step; each rank must run it")
    assert by["compile"]["compared"] == ("dynamo compiled [5] frame(s) by rank over the cell's steps (4 in warmup); "
                                         "compile on compiles each block's forward")
    assert by["checkpoint"]["compared"] == "0 save(s) logged; checkpoints off saves none"
    eager = _by_claim(_cfg(), _worker())
    assert eager["compile"]["compared"] == ("dynamo compiled [0] frame(s) by rank over the cell's steps; an eager cell "
                                            "compiles none")
    assert eager["optimizer"]["compared"].endswith("dispatched [0] time(s) by rank on the counted step; no rank may run it")
    on = _by_claim(_cfg(checkpoint="sync", steps=4, checkpoint_every=2),
                   _worker(checkpoint={"mode": "sync", "saves": 2, "bytes_written_by_rank": [7]}))
    assert on["checkpoint"]["compared"] == ("2 save(s) logged in mode 'sync', bytes written by rank [7]; 4 measured "
                                            "steps, a save every 2: 2 due")
    moe = _by_claim(_cfg(arch="moe", moe_routing="balanced"), _worker(moe={"imbalance_max_over_mean_worst": 1.25}))
    assert moe["moe_routing"]["compared"] == ("busiest expert over the mean, worst layer-step: 1.2500; balanced "
                                              "routing gives 1")


def test_a_contradicted_cell_names_each_claim_in_one_line():
    judged = [{"claim": "ac", "value": "op", "status": "contradicted", "compared": "A"},
              {"claim": "optimizer", "value": "adamw", "status": "checked", "compared": "B"},
              {"claim": "compile", "value": "on", "status": "contradicted", "compared": "C"},
              {"claim": "pp_schedule", "value": "zb", "status": "n/a", "reason": "D"}]
    assert claims.contradicted(judged) == "claim contradicted by the run: ac op: A | compile on: C"
    assert claims.contradicted(judged[1:2] + judged[3:]) is None


def test_whole_entries_as_the_record_holds_them():
    """Each entry whole (claim, value, status, and what was compared or why not), as ``metrics.claims`` holds it."""
    blocks = {"2": {"calls": 4, "matmuls": 24, "every_other": 12, "attn_core": 12}}  # stage 2 of gpt2 tiny's zb
    zb = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule="zb", ac="full")
    assert claims._ac(zb, _worker(forward=24, backward=48 + 9 * 24, blocks=blocks)["observed"]["by_rank"]) == {
        "claim": "ac", "value": "full", "status": "checked",
        "compared": "matmuls recomputed on the counted step equal the policy's on every rank (rank 0: 216 of 24 "
                    "forward); recomputed [9.0] times the policy's by rank, as many as its split backward's passes"}
    first = {"0": blocks["2"]}  # stage 0: one full backward, once
    assert claims._ac(zb, _worker(forward=24, backward=48 + 24, blocks=first)["observed"]["by_rank"])["compared"] == \
        "matmuls recomputed on the counted step equal the policy's on every rank (rank 0: 24 of 24 forward)"
    split_off = claims._ac(zb, _worker(forward=24, backward=48 + 7, blocks=blocks)["observed"]["by_rank"])
    assert split_off == {"claim": "ac", "value": "full", "status": "contradicted",
                         "compared": "rank 0's backward ran 55 matmuls for 24 in its forward: 7 recomputed, where ac "
                                     "full recomputes 216 of what its blocks ran (its split backward's passes counted)"}
    one = {"1": {"calls": 1, "matmuls": 1, "every_other": 0, "attn_core": 0}}  # stage 1: 9 times the policy's 1
    assert claims._ac(zb, _worker(forward=1, backward=2 + 9, blocks=one)["observed"]["by_rank"])["status"] == "checked"
    none_zb = replace_ac(zb, "none")
    assert claims._ac(none_zb, _worker(forward=1, backward=2 + 2, blocks=one)["observed"]["by_rank"])["status"] == \
        "contradicted"  # nothing to recompute: none may run again
    two = [_worker(backward=50)["observed"]["by_rank"][0], _worker(backward=51)["observed"]["by_rank"][0]]
    assert claims._ac(_cfg(), two)["compared"] == ("rank 1's backward ran 51 matmuls for 25 in its forward: 1 "
                                                   "recomputed, where ac none recomputes 0 of what its blocks ran")
    assert claims._routing(_cfg(arch="moe"), {"moe": {"imbalance_max_over_mean_worst": 1.5}}) == {
        "claim": "moe_routing", "value": "learned", "status": "checked",
        "compared": "busiest expert over the mean, worst layer-step: 1.5000 (the router's own choice; balanced "
                    "routing gives 1)"}
    assert claims._routing(_cfg(arch="moe"), {"moe": {"imbalance_max_over_mean_worst": 1.0}}) == {
        "claim": "moe_routing", "value": "learned", "status": "n/a",
        "reason": "n/a: every expert got the same rows on every step, which a learned router can also do"}
    assert claims._routing(_cfg(arch="moe", moe_routing="balanced"), {}) == {
        "claim": "moe_routing", "value": "balanced", "status": "n/a", "reason": "n/a: no expert loads were recorded"}
    assert claims.judge(_cfg(), _worker(backward=50)) == [
        {"claim": "layout", "value": ["single (dp_replicate 1, dp_shard 1, tp 1, pp 1)"], "status": "checked",
         "compared": "every rank's collectives (calls and bytes per kind) equal the model's for this layout"},
        {"claim": "checkpoint", "value": "off", "status": "checked", "compared": "0 save(s) logged; checkpoints off "
                                                                                  "saves none"},
        {"claim": "ac", "value": "none", "status": "checked", "compared": "matmuls recomputed on the counted step "
                                                                           "equal the policy's on every rank (rank 0: 0 of 25 forward)"},
        {"claim": "optimizer", "value": "adamw", "status": "checked",
         "compared": "torch's fused AdamW kernel (aten._fused_adamw_) dispatched [0] time(s) by rank on the counted "
                     "step; no rank may run it"},
        {"claim": "compile", "value": "off", "status": "checked",
         "compared": "dynamo compiled [0] frame(s) by rank over the cell's steps; an eager cell compiles none"},
        {"claim": "model", "value": "tiny", "status": "checked",
         "compared": "every rank built 867,072 parameters, as tiny has"}]


def replace_ac(cfg: CellConfig, ac: str) -> CellConfig:
    return CellConfig.from_dict({**cfg.to_dict(), "ac": ac})


def test_expert_parallels_layout_is_held_at_the_rows_each_rank_routed():
    ep = _cfg(arch="moe", strategy="fsdp+ep", world_size=2, global_batch=8)
    routed = {"counted_step_rows_sent_by_rank": [10, 12], "counted_step_rows_received_by_rank": [12, 10]}
    c = claims._layout(ep, {"comm_by_rank": [{}, {}], "moe": {"ep": routed}})
    assert c == {"claim": "layout", "value": ["fsdp+ep (dp_replicate 1, dp_shard 2, tp 1, pp 1, ep 2)"],
                 "status": "contradicted",
                 "compared": "rank 0's all_gather: counted 0 call(s), 0 bytes; the model 9, 1,876,480 (the all-to-alls "
                             "at the rows each rank recorded routing)"}


@pytest.mark.parametrize(("warm", "frames", "status"), [(1, [1, 1], "checked"), (1, [1, 0], "contradicted"),
                                                        (0, [1, 1], "contradicted"), (None, [3, 3], "contradicted")])
def test_compile_on_needs_frames_in_warmup_and_on_every_rank(warm, frames, status):
    observed = [{**_worker()["observed"]["by_rank"][0], "frames_compiled": f} for f in frames]
    worker = {"compile": {"frames_compiled": warm}} if warm is not None else {}
    c = claims._compile(_cfg(compile=True), worker, observed)
    assert (c["claim"], c["value"], c["status"]) == ("compile", "on", status)
    off = claims._compile(_cfg(), {}, observed)
    assert (off["value"], off["status"]) == ("off", "contradicted")


class _Odd(nn.Module):
    """A block of 3 linears and no attention (every other: 1 a call)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class _NoOut(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)  # an attention without an output projection: no core counted

    def forward(self, x):
        return self.attn(x)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"0": _Odd(), "1": _NoOut()})

    def block_items(self):
        return list(self.blocks.items())

    def forward(self, x):
        for _ in range(2):  # two microbatches through every block
            x = self.blocks["1"](self.blocks["0"](x))
        return x


def test_the_tally_sums_each_blocks_calls_and_leaves_no_hook_behind():
    model = _Twice()
    with OpTally(MATMULS, [model, nn.Linear(4, 4)]) as mode:  # a part without blocks is counted whole, not by block
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert mode.tally.to_json() == {
        "forward_matmuls": 8, "backward_matmuls": 16, "ops": {},
        "blocks": {"0": {"calls": 2, "matmuls": 6, "every_other": 2, "attn_core": 0},
                   "1": {"calls": 2, "matmuls": 2, "every_other": 0, "attn_core": 0}}}
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, m
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    with OpTally(MATMULS, []) as mode:
        opt.step()
        opt.step()
    assert mode.tally.ops == {"fused_adamw": 2}


def test_judge_adds_the_claims_a_cell_makes_by_its_layout_and_precision():
    fp8 = claims.judge(_cfg(precision="fp8", fp8_emulate=True), _worker(backward=50))
    assert [c["claim"] for c in fp8] == ["layout", "checkpoint", "ac", "optimizer", "compile", "model", "fp8"]
    assert fp8[-1] == {"claim": "fp8", "value": {"recipe": "tensorwise", "float8_all_gather": False},
                       "status": "contradicted", "compared": "the float8 linears' configs on every rank: recipe(s) "
                                                             "none, float8 all-gather none"}
    pp = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule="zb")
    worker = {**_worker(backward=50), "observed": {"by_rank": [_worker(backward=50)["observed"]["by_rank"][0]] * 2},
              "comm_by_rank": None}
    judged = claims.judge(pp, worker)
    assert [c["claim"] for c in judged] == ["layout", "checkpoint", "ac", "optimizer", "compile", "model",
                                            "pp_schedule"]
    assert judged[0] == {"claim": "layout", "value": ["pp (dp_replicate 1, dp_shard 1, tp 1, pp 2)", "4 microbatches"],
                         "status": "n/a", "reason": "n/a: the record has no collectives counted per rank"}
    assert judged[-1] == {"claim": "pp_schedule", "value": "zb", "status": "n/a",
                          "reason": "n/a: the stage actions are timed on CPU ranks only (on a GPU the host's clock does "
                                    "not time a stage's kernels); the layout's sends and receives are checked with "
                                    "the collectives"}
    old = claims.judge(_cfg(arch="moe", ac="op"), {"comm_by_rank": [{}]})
    assert [c["claim"] for c in old] == ["layout", "checkpoint", "ac", "moe_routing"]
    assert old[2] == {"claim": "ac", "value": "op", "status": "n/a",
                      "reason": "n/a: the record has no counted step's ops (recorded before claims)"}


@pytest.mark.parametrize(("schedule", "action", "status"), [
    ("zb", {**SPLIT, "backward_weight": 0.0}, "contradicted"), ("zb", {**SPLIT, "backward_input": 0.0}, "contradicted"),
    ("1f1b", {**WHOLE, "backward": 0.5}, "checked")])
def test_a_split_backward_needs_both_passes_timed(schedule, action, status):
    cfg = _cfg(strategy="pp", world_size=2, microbatches=4, pp_schedule=schedule)
    c = claims._schedule(cfg, _pipeline(action, action))
    assert (c["claim"], c["value"], c["status"]) == ("pp_schedule", schedule, status)
    assert c["compared"].endswith("splits every rank's backward (gpipe and 1f1b differ in order only, which the clock "
                                  "does not keep)" if schedule == "zb" else "splits none's backward (gpipe and 1f1b "
                                  "differ in order only, which the clock does not keep)")


def test_balanced_routing_is_exactly_one_and_a_resumed_attempt_says_so():
    c = claims._routing(_cfg(arch="moe", moe_routing="balanced"), {"moe": {"imbalance_max_over_mean_worst": 1.0 + 1e-9}})
    assert (c["claim"], c["value"], c["status"]) == ("moe_routing", "balanced", "contradicted")
    on = _cfg(checkpoint="sync", steps=4, checkpoint_every=2)
    resumed = {"mode": "sync", "saves": 1, "bytes_written_by_rank": [5], "start": {"kind": "resume"}}
    c = _by_claim(on, _worker(checkpoint=resumed))["checkpoint"]
    assert c == {"claim": "checkpoint", "value": "sync", "status": "checked",
                 "compared": "1 save(s) logged in mode 'sync', bytes written by rank [5]; 4 measured steps, a save "
                             "every 2: 2 due (an attempt resumed after some of them: at most)"}
    full = _by_claim(on, _worker(checkpoint={**resumed, "saves": 2}))["checkpoint"]["status"]
    assert full == "checked"  # at most as many as due: all of them, after a resume that saved none
    assert _by_claim(on, _worker(checkpoint={**resumed, "saves": 0, "bytes_written_by_rank": []}))["checkpoint"][
        "status"] == "checked"  # resumed after every due save: none of its own


def test_the_model_claim_holds_every_rank_s_build_to_the_size_the_record_names():
    """gpt2 tiny has 875,264 parameters at 128 positions (tests/unit/test_terms_table.py counts them tensor by
    tensor), 867,072 at :func:`_cfg`'s 64; a rank that built another count contradicts the record, a record from
    before the count cannot be checked."""
    ok = _by_claim(_cfg(), _worker(backward=50))["model"]
    assert ok == {"claim": "model", "value": "tiny", "status": "checked",
                  "compared": "every rank built 867,072 parameters, as tiny has"}
    two = {**_worker(backward=50), "observed": {"by_rank": [_worker(backward=50)["observed"]["by_rank"][0],
                                                            _worker(backward=50, params=2_461_440)["observed"]
                                                            ["by_rank"][0]]}}
    off = _by_claim(_cfg(strategy="ddp", world_size=2), two)["model"]
    assert off["status"] == "contradicted"
    assert off["compared"] == "rank 1 built 2,461,440 parameters; tiny has 867,072"
    old = {**_worker(backward=50)}
    del old["observed"]["by_rank"][0]["params_built"]
    assert _by_claim(_cfg(), old)["model"] == {"claim": "model", "value": "tiny", "status": "n/a",
                                               "reason": "n/a: the record has no count of the parameters built"}


def test_a_config_model_is_named_with_its_shrink():
    from workloads.hf_models import config_model  # noqa: PLC0415

    path = str(REPO / "tests" / "data" / "hf_configs" / "gpt2.json")
    assert claims.model_label(config_model(path, shrunk=True)) == "gpt2 shrunk by rules cpu2"
    assert claims.model_label(config_model(path)) == "gpt2 at full size"
