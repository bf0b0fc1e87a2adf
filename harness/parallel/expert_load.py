"""The harness's side of the MoE layers (:mod:`workloads.moe`): their routing, their balancing step, their load.

After each optimizer step :meth:`ExpertLoad.step` takes every router's count of the tokens it sent
to each expert, sums them over all ranks in one all-reduce (``L x E`` fp32, labelled ``moe_load``
for the comm counter), and gives each router the sum for DeepSeek-V3's bias step, so that every
replica of a router moves its bias alike. Each layer is counted by every rank that holds it:
data- and context-parallel ranks see different tokens (their counts add up to the batch's), a
pipeline stage's ranks hold only their layers (the others add zeros). Where activation checkpointing
runs a block's forward again in its backward (:func:`harness.parallel.activation_checkpoint.reruns_forward`)
the recompute routes the same tokens alike, so that layer's counts are halved; under tensor parallel every tp rank routes (and counts) the same
tokens, so the sum is divided by tp. The sum is kept per step for the record: tokens per expert, and
how far the busiest expert is above the mean. Under expert parallel each step also keeps this rank's
routed, sent-away and received rows (:meth:`ExpertLoad.ep_rows`).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from harness.comm_scope import comm_label
from harness.parallel.activation_checkpoint import reruns_forward
from workloads.moe import MoE
from workloads.sizes import ModelSize

MOE_LOAD_LABEL = "moe_load"
_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def moe_layers(parts: list[nn.Module]) -> list[tuple[int, MoE]]:
    """The MoE layers of the parts this rank holds, with their block index."""
    out = []
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                block = _BLOCK.search(name + ".")
                assert block is not None, f"MoE layer {name!r} is not inside a block"
                out.append((int(block.group(1)), module))
    return out


class ExpertLoad:
    """Routing, the balancing step and the load record of one rank's MoE layers."""

    def __init__(self, parts: list[nn.Module], size: ModelSize, routing: str, ac: str, device: torch.device,
                 ranges=None, tp: int = 1) -> None:
        """``ranges``: the run's NVTX ranges (:class:`harness.measure.nvtx_ranges.Ranges`), entered around
        each layer's ``dispatch``, ``experts`` and ``combine``; ``tp``: the tensor-parallel degree, whose
        ranks route the same tokens (``fsdp+tp+ep``), each counting them."""
        self.layers = moe_layers(parts)
        assert size.moe is not None, f"ExpertLoad: {size.key} has no MoE layer"
        self.shape = (size.moe_layers, size.moe.n_experts)
        self.row = {i: i - size.dense_layers for i in range(size.dense_layers, size.n_layers)}
        """Each MoE block's row of the load: an MoE model's dense first blocks route nothing."""
        self.device = device
        self.passes = {i: 2 if reruns_forward(ac, i) else 1 for i, _ in self.layers}
        """Forwards per micro-batch of each layer (its block index)."""
        self.tp = tp
        self.steps: list[torch.Tensor] = []
        """Every step's load, warmup included (the loss curve's steps, which parity compares)."""
        self.first = 0
        """The first measured step: the summary covers the measured window."""
        self.dispatchers = [(i, layer.dispatcher) for i, layer in self.layers
                            if hasattr(layer.dispatcher, "take_counts")]
        self.ep_steps: list[tuple[float, ...]] = []
        """Expert parallel: every step's rows this rank routed, sent away and received (all its layers), and the
        rows it routed and received in the layers whose forward ran again in backward (activation checkpointing)."""
        for _, layer in self.layers:
            layer.router.routing = routing
            if ranges is not None:
                layer.ranges = ranges.range

    def step(self) -> None:
        load = torch.zeros(self.shape, device=self.device)
        for i, layer in self.layers:
            load[self.row[i]] = layer.router.take_load() / self.passes[i]
        if dist.is_initialized() and dist.get_world_size() > 1:
            with comm_label(MOE_LOAD_LABEL):
                dist.all_reduce(load)
        load /= self.tp  # every tp rank counted its tokens
        for i, layer in self.layers:
            layer.router.update_bias(load[self.row[i]])
        self.steps.append(load)
        if self.dispatchers:
            counts = [([n / self.passes[i] for n in d.take_counts()], self.passes[i] > 1) for i, d in self.dispatchers]
            rows = [sum(c[j] for c, _ in counts) for j in range(3)]
            rerun = [sum(c[j] for c, again in counts if again) for j in (0, 2)]
            self.ep_steps.append((*rows, *rerun))

    def ep_rows(self) -> dict[str, list[float]] | None:
        """Expert parallel only: this rank's routed rows per step (every layer's token x slot rows, forward
        once), the rows among them sent to another rank, the rows its experts received, and the routed and
        received rows of the layers whose forward ran again (``rerun_routed``, ``rerun_received``)."""
        if not self.dispatchers:
            return None
        keys = ("routed", "left", "received", "rerun_routed", "rerun_received")
        columns = list(zip(*self.ep_steps)) if self.ep_steps else [()] * len(keys)
        return {k: list(v) for k, v in zip(keys, columns, strict=True)}

    def window_start(self) -> None:
        """The measured window starts at the next step: the summary covers it."""
        self.first = len(self.steps)

    def per_step(self) -> list[list[list[float]]]:
        """Every step's load so far (steps x layers x experts), for the record's samples."""
        return torch.stack(self.steps).cpu().tolist() if self.steps else []

    def summary(self) -> dict:
        """Tokens per expert per step (layers x experts, the mean over the measured steps) and the imbalance:
        busiest expert over the mean, the mean over layers and steps and the worst layer-step."""
        if len(self.steps) <= self.first:
            return {}
        loads = torch.stack(self.steps[self.first:]).cpu()  # (steps, L, E)
        ratio = loads.amax(-1) / loads.mean(-1)
        return {"tokens_per_expert": loads.mean(0).tolist(),
                "imbalance_max_over_mean": ratio.mean().item(),
                "imbalance_max_over_mean_worst": ratio.max().item()}
