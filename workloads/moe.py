"""The mixture-of-experts layer of the ``moe`` family (:class:`workloads.sizes.MoESpec`).

* **Router**: token choice. Softmax over the E experts' scores (or each expert's sigmoid: DeepSeek-V3); each token
  picks its top k (DeepSeek-V3: within its ``topk_group`` best groups of experts) and weights their outputs by its
  scores, renormalised over the k where the architecture does (``norm_topk``), times ``routed_scale``. ``routing = "balanced"`` replaces
  the choice by a round robin over positions (token at position s, slot j: expert ``(s k + j) mod E``),
  the forced balance Megatron-Bridge uses for its published MoE rows: best-case throughput, with
  the same renormalised weights. Under ``bias`` balancing (DeepSeek-V3) a per-expert bias, a
  buffer, is added to the scores for the choice only; :meth:`Router.update_bias` moves it after a
  step by ``rate x sign(mean load - load)`` from the load the caller counted (over every rank).
  Under ``aux`` the Switch loss ``coef E sum_e f_e P_e`` over this micro-batch joins the backward
  (:class:`_AuxLoss`) without changing the loss the model reports.
* **Experts**: E SwiGLU experts as three stacked weights (``gate`` and ``up`` ``(E, f, d)``, ``proj``
  ``(E, d, f)``, each expert laid out as an ``nn.Linear`` weight), so FSDP and expert parallel
  shard them along experts (dim 0). Dropless: every token reaches its k experts at any load.
* **Dispatch**: tokens are grouped by expert (a stable sort of their choices), each expert runs
  on its group, the outputs are scaled by the weights and summed back per token. The layer's
  ``dispatcher`` moves the groups to where their experts are: :class:`LocalDispatch` when every
  expert is on this rank; expert parallel sets one that exchanges them by all-to-all
  (:mod:`harness.parallel.ep`), with the experts' weights sharded along dim 0.
* Each phase runs inside ``ranges(name)`` (``dispatch``, ``experts``, ``combine``): a no-op here;
  the harness attaches its NVTX ranges, so the workloads import nothing of the harness.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workloads.layers import SwiGLU, positions_of
from workloads.model_parts import MoESpec

ROUTINGS = ("learned", "balanced")
WIDTH_DIM = {"gate": 1, "up": 1, "proj": 2}
"""The dimension of each stacked expert weight that holds the expert's width (``d_ff``), split over tp."""


class Router(nn.Module):
    expert_bias: torch.Tensor  # buffers, registered in __init__ (nn.Module's __getattr__ types them loosely)
    load: torch.Tensor

    def __init__(self, d_model: int, spec: MoESpec) -> None:
        super().__init__()
        self.n_experts, self.top_k = spec.n_experts, spec.top_k
        self.score = nn.Linear(d_model, spec.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(spec.n_experts))
        self.register_buffer("load", torch.zeros(spec.n_experts), persistent=False)
        """Tokens routed to each expert since the last :meth:`take_load` (this rank's)."""
        self.routing = "learned"
        self.bias_rate = spec.bias_rate if spec.balancing == "bias" else 0.0
        self.scoring, self.norm_topk, self.routed_scale = spec.score, spec.norm_topk, spec.routed_scale
        self.n_group, self.topk_group = spec.n_group, spec.topk_group

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``x`` (N, d), ``positions`` (N,; balanced routing only): the chosen experts (N, k), their weights (N, k) in x's dtype,
        every expert's scores (N, E) in fp32 and the tokens each expert got (E,)."""
        logits = self.score(x).float()
        probs = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        if self.routing == "balanced":
            assert positions is not None, "balanced routing needs the tokens' positions"
            slots = positions.unsqueeze(-1) * self.top_k + torch.arange(self.top_k, device=x.device)
            choice = slots % self.n_experts
        else:
            with torch.no_grad():
                choice = self._top_k(probs + self.expert_bias)
        weights = probs.gather(-1, choice)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        flat_choice = choice.flatten()  # a scatter, not bincount: its shape does not depend on the values
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_choice, torch.ones_like(flat_choice))
        with torch.no_grad():
            self.load += counts.to(self.load.dtype)
        return choice, weights.to(x.dtype), probs, counts

    def _top_k(self, scores: torch.Tensor) -> torch.Tensor:
        """The k best experts of each token's ``scores`` (N, E); under group-limited routing (DeepSeek-V3) among the
        ``topk_group`` groups whose two best scores sum highest, the other groups' experts masked out."""
        if self.n_group == 1:
            return scores.topk(self.top_k, dim=-1).indices
        grouped = scores.view(scores.shape[0], self.n_group, -1)  # (N, G, E / G)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (N, G)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
        return masked.topk(self.top_k, dim=-1).indices

    def take_load(self) -> torch.Tensor:
        """The tokens per expert counted since the last call; the count restarts."""
        load = self.load.clone()
        self.load.zero_()
        return load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step: underloaded experts' bias up, overloaded ones' down. ``load``
        must be counted over every rank that routes tokens (any positive multiple of it will do:
        only its sign against the mean counts), so that every replica of the router moves alike."""
        if self.bias_rate:
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also seeds ``aux``'s gradient with 1: the auxiliary loss
    trains the router as if added to the loss, while the loss reported stays the model's."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class Experts(nn.Module):
    """``n`` SwiGLU experts, stacked. ``forward(x, counts)``: rows of ``x`` grouped by expert, ``counts[e]``
    rows for expert e (this module's e-th), in order."""

    def __init__(self, n: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.up = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.proj = nn.Parameter(torch.empty(n, d_model, d_ff))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # sharded weights (expert parallel: a DTensor over the experts) compute on this rank's experts; unbound once,
        # so the backward stacks the experts' gradients into one tensor (indexing each expert instead allocates a
        # zero tensor of every expert's size per expert: 2x the weight's bytes more at the backward's peak)
        gate, up, proj = (w.to_local().unbind(0) if hasattr(w, "to_local") else w.unbind(0)
                          for w in (self.gate, self.up, self.proj))
        outs = [F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), proj[e])
                for e, xe in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x[:0]


def even_split(rows: int, parts: int) -> list[int]:
    """``rows`` in ``parts`` sizes differing by at most one, the larger first."""
    q, r = divmod(rows, parts)
    return [q + 1] * r + [q] * (parts - r)


class Dispatch(Protocol):
    """What an MoE layer's ``dispatcher`` does: :class:`LocalDispatch` here, an all-to-all under expert parallel."""

    def dispatch(self, grouped: torch.Tensor, counts: torch.Tensor, even: bool) -> tuple[torch.Tensor, list[int], Any]:
        """The rows for this rank's experts, how many each gets, and the state :meth:`combine` takes."""
        ...

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs back in ``grouped``'s order."""
        ...


class LocalDispatch:
    """Every expert on this rank: the grouped rows stay where they are."""

    def dispatch(self, grouped: torch.Tensor, counts: torch.Tensor, even: bool) -> tuple[torch.Tensor, list[int], None]:
        """``grouped`` rows by expert, ``counts`` (E,) per expert: the rows for this rank's experts, how
        many each expert gets, and what :meth:`combine` needs to send the outputs back."""
        return grouped, even_split(grouped.shape[0], counts.shape[0]) if even else counts.tolist(), None

    def combine(self, y: torch.Tensor, state: None) -> torch.Tensor:
        """The experts' outputs back in ``grouped``'s order."""
        return y


class MoE(nn.Module):
    """Router, experts and the optional shared expert: a drop-in for a block's MLP, ``(B, T, d) -> (B, T, d)``."""

    seq_shard = None
    even_split = False
    """Split the grouped tokens evenly over the experts instead of by the routed counts: for tensors
    without values (FakeTensorMode, ``harness fit``), whose counts cannot be read on the host. The
    shapes are then those of a perfectly balanced load."""

    def __init__(self, d_model: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.router = Router(d_model, spec)
        self.experts = Experts(spec.n_experts, d_model, spec.d_ff)
        self.shared = SwiGLU(d_model, spec.n_shared * spec.d_ff) if spec.n_shared else None
        self.ranges = lambda name: contextlib.nullcontext()
        self.dispatcher: Dispatch = LocalDispatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        balanced = self.router.routing == "balanced"  # only a round robin needs the positions
        positions = positions_of(self.seq_shard, t, x.device).repeat(b) if balanced else None
        choice, weights, probs, counts = self.router(flat, positions)
        k, n_experts = self.spec.top_k, self.spec.n_experts
        with self.ranges("dispatch"):
            order = choice.flatten().argsort(stable=True)  # the N k slots, grouped by expert
            token = order // k
            rows, local_counts, state = self.dispatcher.dispatch(flat[token], counts, self.even_split)
        with self.ranges("experts"):
            y = self.experts(rows, local_counts)
        with self.ranges("combine"):
            y = self.dispatcher.combine(y, state) * weights.flatten()[order].unsqueeze(-1)
            out = torch.zeros_like(flat).index_add(0, token, y)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.spec.balancing == "aux" and self.training and torch.is_grad_enabled():
            share = counts.float() / (flat.shape[0] * k)  # f_e: the fraction of routed slots
            aux = self.spec.aux_coef * n_experts * (share * probs.mean(dim=0)).sum()
            out = _AuxLoss.apply(out, aux)
        return out.view(b, t, d)
