"""Autocast's low-precision copies of the weights: which linears it casts, how many bytes one rank's copies hold, and
how long each lives (:func:`autocast_copy_bytes`, a term of :func:`harness.model.memory.stage_peak_bytes`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch import nn

from harness.model.block_ops import fp8_linears
from harness.model.inventory import (
    held_shape,
    param_specs,
    rank_layer_ids,
    rank_params,
)
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import checkpointed_layer
from harness.parallel.dims import ParallelDims
from workloads.meta import on_meta
from workloads.model import Decoder
from workloads.sizes import ModelSize


def autocast_casts_weights(c: CellShape) -> bool:
    """Whether autocast casts the weights: under mixed precision (bf16, fp16, fp8) without FSDP, whose
    ``MixedPrecisionPolicy(param_dtype=low)`` gathers them in autocast's dtype already (autocast uses a tensor of its
    own dtype as it is: no copy is made under fsdp)."""
    return c.compute_bytes != 4 and not c.fsdp


@functools.lru_cache(maxsize=64)
def _linear_modules(size: ModelSize) -> frozenset[str]:
    """The model's ``nn.Linear`` modules by name (the module tree on the meta device, as :func:`param_specs`): the
    weights and biases autocast casts. Norms, embeddings and the loss run in fp32 and cast no weight."""
    with on_meta():
        model = Decoder(size)
    return frozenset(name for name, m in model.named_modules() if isinstance(m, nn.Linear))


@functools.lru_cache(maxsize=64)
def _fp8_modules(size: ModelSize) -> frozenset[str]:
    return frozenset(fp8_linears(size))


@dataclass(frozen=True)
class WeightCopies:
    """Bytes of the low-precision copies autocast makes of one block's weights on one rank (:func:`weight_copies`)."""

    cached: int
    """Every linear's weight and bias, cast at first use and held by autocast's cache to the end of the region."""
    kept: int
    """The weights' copies the block's linears keep for its backward once the region ends (a bias's copy is not kept:
    the backward needs none), freed by that block's backward; none where the policy recomputes the linear."""
    recast: int
    """What the block's backward casts again to recompute (every weight where the block is checkpointed whole or under
    ``op``, the attention core's under ``attn``), held until that backward ends."""
    experts: int
    """Stacked experts' copies a kept block makes per microbatch: each expert's weight is a view (``unbind``), which
    autocast never caches, so every use casts it again and the expert's linears keep it."""


@functools.lru_cache(maxsize=4096)
def _cast_numel(size: ModelSize, dims: ParallelDims, fp8: bool, layer: int) -> tuple[int, int, int, int]:
    """Elements of block ``layer``'s tensors autocast casts on one rank (tp and ep local): every linear's weight and
    bias, their weights, the attention core's weights (every linear of ``attn`` but its output projection), the
    stacked experts. fp8's converted linears cast none."""
    linears = _linear_modules(size)
    converted = _fp8_modules(size) if fp8 else frozenset()
    cached = weights = core = experts = 0
    for p in param_specs(size):
        if p.layer != layer:
            continue
        n = math.prod(held_shape(p, dims))
        module, kind = p.name.rsplit(".", 1)
        if p.expert:
            experts += n
        elif module in linears and module not in converted:
            cached += n
            weights += n if kind == "weight" else 0
            core += n if kind == "weight" and ".attn." in module and not module.endswith(".attn.out") else 0
    return cached, weights, core, experts


def weight_copies(c: CellShape, layer: int) -> WeightCopies:
    """Autocast's copies of block ``layer``'s weights on one rank, by when they live (:class:`WeightCopies`).

    torch's ``cached_cast`` caches the low-precision copy of a leaf fp32 tensor that requires grad (not a view) until
    the outermost autocast region exits (``clear_autocast_cache``); the harness's step exits it after the loss, before
    ``backward`` (:mod:`harness.run.train`), and a checkpoint's recomputation enters and exits a region of its own. A
    linear saves the copy of its weight for its input's gradient. fp8's converted linears cast their weights to float8
    inside their own autograd function, freed after the matmul: none counted. Measured with
    :class:`harness.measure.tensor_bytes.TensorBytes` (each ``_to_copy`` of a parameter) on llama3, gpt2 and moe blocks
    under CPU autocast bf16, every policy: within the forward's region every linear's weight and bias (the experts
    only where the block keeps them); after it, every weight under ``none``, all but q, k and v under ``attn``, none
    under ``op`` and in a checkpointed block (tests/unit/test_autocast_copies.py).
    """
    if not autocast_casts_weights(c):
        return WeightCopies(0, 0, 0, 0)
    cached, weights, core, experts = (c.compute_bytes * n for n in _cast_numel(c.size, c.dims, c.precision == "fp8",
                                                                                layer))
    if checkpointed_layer(c.recompute, layer) or c.recompute == "op":
        return WeightCopies(cached, kept=0, recast=weights + experts, experts=0)
    if c.recompute == "attn":  # the core (q, k, v; MLA's down and up projections) is recomputed
        return WeightCopies(cached, kept=weights - core, recast=core, experts=experts)
    return WeightCopies(cached, kept=weights, recast=0, experts=experts)


def autocast_copy_bytes(c: CellShape, pp_rank: int) -> tuple[int, int, int, int]:
    """Autocast's weight copies on pipeline rank ``pp_rank`` at four moments of the step (:func:`stage_peak_bytes`):
    the forward's end (the loss computed, still inside autocast), the loss's backward, the top block's backward and
    the bottom block's; none at the optimizer step. The experts' copies of kept blocks are saved per microbatch, with
    the activations (:func:`_stage_keep_bytes`).

    Without a pipeline the forward's region ends at the loss: at its end the cache holds every linear's copy on the
    rank, the LM head's included (:attr:`WeightCopies.cached`); then each block's linears keep theirs
    (:attr:`WeightCopies.kept`) until its backward, the head's until the head's backward, and a recomputed block's
    backward casts its own again (:attr:`WeightCopies.recast`). A pipeline's schedule runs forward and backward inside
    one region (:mod:`harness.run.train`): every copy lives to the step's end and a recomputation finds it cached.

    Not counted: the low-precision gradient of each cast weight before its fp32 copy is added into ``.grad`` (one
    linear's at a time); in a pipeline a recomputed block's expert copies; fp8's float8 weight copies (one linear's at
    a time) and, on a CPU, torchao's emulation upcasting them for its matmuls.
    """
    layers = rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, pp_rank, c.v_shape)
    copies = [weight_copies(c, i) for i in layers]
    head = 0
    if autocast_casts_weights(c):
        linears = _linear_modules(c.size)
        head = sum(c.compute_bytes * math.prod(held_shape(p, c.dims))
                   for p in rank_params(c.size, c.dims, c.virtual, pp_rank, c.v_shape)
                   if p.layer is None and p.name.rsplit(".", 1)[0] in linears)
    region = sum(x.cached for x in copies) + head
    if c.dims.pp_enabled:
        return region, region, region, region
    kept = sum(x.kept for x in copies)
    bottom = copies[0]
    return region, kept + head, kept + copies[-1].recast, bottom.kept + bottom.recast + bottom.experts
