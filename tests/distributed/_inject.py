"""Test-only faults for ``run_cells(..., inject="tests.distributed._inject:NAME")``: never imported by the harness.

Each function runs in a rank process before its cells, and patches the harness the way a bug in
the product would change it.
"""

from __future__ import annotations

import harness.run.train as train
from harness.measure.timer import StepTimer

SLOW_RANK = 1
SLOW_RANK_EXTRA_S = 0.25


def double_grads(rank: int) -> None:
    """Every gradient doubled after the backward (as a data-parallel sum instead of a mean would)."""
    original = train._forward_backward

    def doubled(ctx, x, y):
        loss = original(ctx, x, y)
        for p in ctx.par.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
        return loss

    train._forward_backward = doubled


def slow_rank(rank: int) -> None:
    """Rank ``SLOW_RANK``'s clock reads every step ``SLOW_RANK_EXTRA_S`` longer than it took.

    A real delay on one rank would not do: the next step's collectives make its peers wait for
    it, and the delay spreads to every rank's time. The record must keep the slowest rank.
    """
    if rank != SLOW_RANK:
        return
    original = StepTimer.stop

    def stop(self) -> float:
        return original(self) + SLOW_RANK_EXTRA_S

    StepTimer.stop = stop


FP8_WRONG_SCALE = 4.0


def fp8_wrong_scale(rank: int) -> None:
    """Every float8 scale 4x too large (as an amax taken over one shard instead of the whole tensor can make it):
    every value above a quarter of its tensor's amax saturates at float8's largest."""
    import torchao.float8.float8_scaling_utils as scaling  # noqa: PLC0415 (torchao: the fp8 extra)

    original = scaling.tensor_to_scale

    def too_large(*args, **kwargs):
        return original(*args, **kwargs) * FP8_WRONG_SCALE

    scaling.tensor_to_scale = too_large


FP8_LEFT_OUT = "blocks.1.mlp.fc"


def fp8_unconverted_linear(rank: int) -> None:
    """One MLP linear left out of the float8 conversion (a filter that drops a name)."""
    import harness.precision as precision  # noqa: PLC0415

    original = precision.fp8_eligible
    precision.fp8_eligible = lambda module, fqn: fqn != FP8_LEFT_OUT and original(module, fqn)


def fp8_converted_head(rank: int) -> None:
    """The LM head converted too (a filter that forgets it: torchtitan and this harness keep it in bf16)."""
    import torch  # noqa: PLC0415

    import harness.precision as precision  # noqa: PLC0415

    original = precision.fp8_eligible
    precision.fp8_eligible = lambda module, fqn: original(module, fqn) or (
        isinstance(module, torch.nn.Linear) and fqn == "head")


# Levers recorded but not applied (issue 61): each leaves the record's claim standing while the run does otherwise;
# harness.run.claims must find every one (tests/distributed/test_claims_planted.py).

def ac_not_applied(rank: int) -> None:
    """Activation checkpointing skipped (a policy that maps to nothing): the record says ``ac op``."""
    import harness.parallel.parallelize as parallelize  # noqa: PLC0415

    parallelize.apply_ac = lambda part, mode: None


def ac_full_for_op(rank: int) -> None:
    """Every policy applied as ``full`` (a lookup that falls through to the default)."""
    import harness.parallel.parallelize as parallelize  # noqa: PLC0415

    original = parallelize.apply_ac
    parallelize.apply_ac = lambda part, mode: original(part, "full" if mode != "none" else mode)


def fused_not_applied(rank: int) -> None:
    """``adamw-fused`` built as torch's default AdamW (a flag dropped on its way to the constructor)."""
    import harness.run.cell_build as cell_build  # noqa: PLC0415

    original = cell_build.build_optimizer
    cell_build.build_optimizer = lambda params, kind, lr: original(params, "adamw", lr)


def compile_not_applied(rank: int) -> None:
    """``compile on`` recorded, every block left eager."""
    import harness.parallel.parallelize as parallelize  # noqa: PLC0415

    parallelize.apply_compile = lambda part: None


def sp_not_applied(rank: int) -> None:
    """Tensor parallel built without sequence parallel while the record says it is on."""
    import harness.parallel.parallelize as parallelize  # noqa: PLC0415

    original = parallelize.apply_tp
    parallelize.apply_tp = lambda part, mesh, sequence_parallel, *a, **kw: original(part, mesh, False, *a, **kw)


def fp8_tensorwise_for_rowwise(rank: int) -> None:
    """Every fp8 recipe built as tensorwise (the recipe's name lost), the record saying rowwise."""
    from dataclasses import replace  # noqa: PLC0415

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    import harness.precision as precision  # noqa: PLC0415

    def convert(self, module):
        config = replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=self.fp8.emulate,
                         enable_fsdp_float8_all_gather=self.fp8.all_gather)
        convert_to_float8_training(module, config=config, module_filter_fn=precision.fp8_eligible)
        return [name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"]

    precision.PrecisionPlan.convert_linears = convert


def zb_as_interleaved(rank: int) -> None:
    """The zero-bubble schedule built as interleaved 1F1B (same stages per rank, same sends: a whole backward)."""
    import harness.parallel.pipeline_run as pipeline_run  # noqa: PLC0415

    pipeline_run.ScheduleInterleavedZeroBubble = pipeline_run.ScheduleInterleaved1F1B


def balanced_routing_not_applied(rank: int) -> None:
    """``moe_routing balanced`` recorded, every router left learned."""
    import workloads.moe as moe  # noqa: PLC0415

    original = moe.Router.forward

    def learned(self, x, positions):
        self.routing = "learned"
        return original(self, x, positions)

    moe.Router.forward = learned


def checkpoint_not_saved(rank: int) -> None:
    """``--checkpoint sync`` recorded, the saves never made (a due check that never fires)."""
    import harness.run.checkpoint as checkpoint  # noqa: PLC0415

    checkpoint.Checkpointer.due = lambda self, measured: False


def fp8_all_gather_not_applied(rank: int) -> None:
    """``--fp8-all-gather on`` recorded, FSDP left gathering bf16 weights (the switch lost on its way to torchao)."""
    from dataclasses import replace  # noqa: PLC0415

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    import harness.precision as precision  # noqa: PLC0415

    def convert(self, module):
        config = replace(Float8LinearConfig.from_recipe_name(self.fp8.recipe), emulate=self.fp8.emulate,
                         enable_fsdp_float8_all_gather=False)
        convert_to_float8_training(module, config=config, module_filter_fn=precision.fp8_eligible)
        return [name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"]

    precision.PrecisionPlan.convert_linears = convert


def shrink_layers_not_applied(rank: int) -> None:
    """A config model recorded as shrunk (width, heads, vocabulary, layers) but built with every layer its config has:
    the shrink's layer cap dropped on the way to the build (gpt2's config.json has 12 blocks, the shrink keeps 4)."""
    from dataclasses import replace  # noqa: PLC0415

    import harness.run.cell_build as cell_build  # noqa: PLC0415
    from workloads.hf_models import model_from_origin  # noqa: PLC0415

    original = cell_build.Decoder

    def built(size):
        if size.origin is not None and size.origin.shrink:
            size = replace(size, n_layers=model_from_origin({**size.origin.as_dict(), "shrink": None}).n_layers)
        return original(size)

    cell_build.Decoder = built
