"""How many times a zero-bubble schedule's split backward runs a checkpointed block's forward again.

torch's pipelining splits each backward into an input pass and a weight pass (torch/distributed/pipelining/stage.py,
``backward_one_chunk`` with ``full_backward=False`` and ``backward_weight_one_chunk``; _backward.py):

* **Any stage but the first** runs ``stage_backward_input``, one autograd pass, then ``stage_backward_weight``: one
  ``torch.autograd.grad`` per parameter group. ``get_param_groups`` makes a group of the parameters whose gradient
  paths meet the input-gradient graph at the same nodes: a linear's weight and bias (one ``addmm``), a norm's weight
  and bias (one op), and each of an expert layer's weight tensors apart (each feeds its own GEMMs).
* **The first stage** (its input needs no gradient) skips the input pass and runs one full backward in its weight
  step.
* **Not every backward is split**: ``zb`` and ``zbv`` split all of them, DualPipeV only some (its action list, which
  :func:`harness.model.pipeline_sim.schedule_order` reads from torch's schedule class: at pp 2 and 4 microbatches
  one of each stage's four; the rest run one full backward).

Non-reentrant checkpointing recomputes a region in every autograd pass that unpacks a tensor the region saved, up to
its last saved tensor (early stop). The input pass unpacks every block's; a weight group unpacks its block's when its
module ran inside the region (a linear's input, a norm's normalised input were saved there). So a checkpointed block
of any stage but the first runs its recomputation ``1 + s G`` times per microbatch, G its groups inside the region
(every group of a block checkpointed whole; the q, k and v projections' under ``attn``) and s the share of the
stage's backwards that are split, and once on the first stage.

This reproduces every count measured at 2 ranks and 4 microbatches (docs/claims.md,
results/reference/pp-split-recompute-cpu-tiny-w2): ``zb`` and ``zbv`` under ``full`` 9x (gpt2: q, k, v, out, fc,
proj, two LayerNorms), 10x (llama3) and 11x (moe: the router and three expert tensors for the MLP's three) on the
rank without the first stage, the mean of once and that on the rank with it; ``attn`` 4x and 2.5x; DualPipeV a
quarter of the further passes.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.model.op_record import RECOMPUTE, Op
from harness.model.pipeline_sim import schedule_order

JOINT = frozenset({"weight", "bias"})
"""A module's parameters by these names feed one op together (``addmm``, a norm): one parameter group."""


def param_group(local_name: str) -> tuple[str, str]:
    """(module, group) of a block parameter by its name in the block (``attn.q.weight`` -> ``attn.q``, one group with
    its bias; ``mlp.experts.gate`` -> a group of its own)."""
    module, _, leaf = local_name.rpartition(".")
    return module, module if leaf in JOINT else local_name


def weight_groups_in_region(block_ops: Iterable[Op], param_names: Iterable[str]) -> int:
    """G: the parameter groups whose module ran inside the checkpointed region, as the block's recomputation (its
    ``RECOMPUTE`` ops, by module) shows the region."""
    region = {op.module for op in block_ops if op.phase == RECOMPUTE}
    return len({group for module, group in map(param_group, param_names) if module in region})


def split_share(schedule: str, pp: int, microbatches: int, stage: int) -> float:
    """The share of stage ``stage``'s backwards that ``schedule`` splits into input and weight passes."""
    kinds = [k for actions in schedule_order(schedule, pp, microbatches).values() for k, s, _ in actions
             if s == stage and k in ("I", "B")]
    return kinds.count("I") / len(kinds) if kinds else 0.0


def block_recomputes(block_ops: Iterable[Op], param_names: Iterable[str], first_stage: bool, share: float) -> float:
    """How many times per microbatch a pipelined backward runs this block's recomputation: once on the first stage,
    else ``1 + share x G`` (the module docstring)."""
    return 1.0 if first_stage else 1.0 + share * weight_groups_in_region(block_ops, param_names)
