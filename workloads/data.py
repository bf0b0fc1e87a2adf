"""Seeded, learnable synthetic tokens: a fixed sparse first-order Markov chain.

Every token has ``branching`` possible successors with Dirichlet-drawn probabilities, so
next-token prediction has a known floor: the chain's entropy rate
``H = sum_i pi_i * H(P_i)`` (nats/token), with ``pi`` the stationary distribution.
A model that learns the transition table approaches ``H``; random tokens would keep the
loss flat at ``ln V`` and make loss curves meaningless.

Batches depend only on ``(seed, step)``: every strategy and every rank builds the same
global batch and takes its own slice, which is what makes loss curves comparable across
parallel layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class MarkovData:
    vocab_size: int
    seq_len: int
    seed: int = 0
    branching: int = 4
    """Successors per token: lower means a lower entropy floor."""
    concentration: float = 0.5
    """Dirichlet concentration of each row's successor probabilities."""
    _succ: np.ndarray = field(init=False, repr=False)
    _cum: np.ndarray = field(init=False, repr=False)
    _stationary: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.vocab_size < self.branching:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be >= branching ({self.branching})")
        rng = np.random.default_rng(self.seed + 7919)
        v, k = self.vocab_size, self.branching
        # Successor sets: token i may go to i+1 (keeps the chain irreducible) and k-1 random tokens.
        succ = np.empty((v, k), dtype=np.int64)
        succ[:, 0] = (np.arange(v) + 1) % v
        succ[:, 1:] = rng.integers(0, v, size=(v, k - 1))
        probs = rng.dirichlet(np.full(k, self.concentration), size=v)
        self._succ = succ
        self._probs = probs
        self._cum = np.cumsum(probs, axis=1)
        self._cum[:, -1] = 1.0
        self._stationary = self._stationary_distribution()

    def _stationary_distribution(self, iters: int = 2000, tol: float = 1e-12) -> np.ndarray:
        v = self.vocab_size
        pi = np.full(v, 1.0 / v)
        for _ in range(iters):
            nxt = np.zeros(v)
            np.add.at(nxt, self._succ, pi[:, None] * self._probs)
            # Lazy step (average with the previous) guarantees convergence on periodic chains.
            nxt = 0.5 * (nxt + pi)
            if np.abs(nxt - pi).sum() < tol:
                pi = nxt
                break
            pi = nxt
        return pi / pi.sum()

    @property
    def entropy_floor(self) -> float:
        """Entropy rate in nats/token: the lowest expected next-token loss any model can reach."""
        p = self._probs
        row_h = -(p * np.log(np.clip(p, 1e-300, None))).sum(axis=1)
        # Duplicate successors in a row make the true row entropy lower; merge them exactly.
        for i in np.nonzero([len(set(r)) < self.branching for r in self._succ])[0]:
            merged: dict[int, float] = {}
            for s, q in zip(self._succ[i], p[i]):
                merged[int(s)] = merged.get(int(s), 0.0) + float(q)
            q = np.array(list(merged.values()))
            row_h[i] = -(q * np.log(np.clip(q, 1e-300, None))).sum()
        return float((self._stationary * row_h).sum())

    @property
    def uniform_loss(self) -> float:
        """Loss of a model that knows nothing: ``ln V``."""
        return float(np.log(self.vocab_size))

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch for ``step``: inputs and next-token targets, each ``(batch_size, seq_len)`` int64."""
        rng = np.random.default_rng([self.seed, step])
        t = self.seq_len + 1
        toks = np.empty((batch_size, t), dtype=np.int64)
        toks[:, 0] = rng.choice(self.vocab_size, size=batch_size, p=self._stationary)
        u = rng.random((batch_size, t - 1))
        for j in range(1, t):
            prev = toks[:, j - 1]
            choice = (u[:, j - 1, None] > self._cum[prev]).sum(axis=1)
            toks[:, j] = self._succ[prev, choice]
        x = torch.from_numpy(toks[:, :-1].copy())
        y = torch.from_numpy(toks[:, 1:].copy())
        return x, y
