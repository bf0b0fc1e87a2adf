"""Named model sizes, their exact parameter counts and FLOPs per token.

FLOP conventions (per token, forward + backward, recompute not counted):

* PaLM (Chowdhery et al. 2022, appendix B; torchtitan, picotron):
  ``6 * N + 12 * L * d * S``. N counts every parameter that takes part in a matmul
  (all parameters except the token and position embedding tables, which are
  lookups), L layers, d model width, S sequence length. The second term is the
  attention score and value matmuls over the full S x S square.
* Megatron (Narayanan et al. 2021) with causal masking: the attention term is
  halved because half the square is masked: ``6 * N + 6 * L * d * S``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    """One reference workload: a pre-LayerNorm GPT decoder."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    device_kind: str
    """Where this size is meant to run by default: ``cpu`` sizes are sized for a 2-core CPU."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    @property
    def params_embedding(self) -> int:
        """Token and position embedding tables (lookups: no FLOPs)."""
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def params_per_layer(self) -> int:
        d, f = self.d_model, self.d_ff
        attn = 4 * (d * d + d)  # q, k, v, out projections with bias
        mlp = d * f + f + f * d + d  # fc (d -> 4d) and proj (4d -> d) with bias
        norms = 2 * 2 * d  # two LayerNorms, weight and bias
        return attn + mlp + norms

    @property
    def params_nonembedding(self) -> int:
        """N of the FLOP formula: blocks, final norm and the (untied) LM head."""
        final_norm = 2 * self.d_model
        head = self.d_model * self.vocab_size  # no bias
        return self.n_layers * self.params_per_layer + final_norm + head

    @property
    def params(self) -> int:
        """Exact total parameter count of :class:`workloads.model.GPT` at this size."""
        return self.params_embedding + self.params_nonembedding

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """PaLM convention: ``6*N + 12*L*d*S`` (fwd + bwd, full attention square)."""
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.params_nonembedding + 12 * self.n_layers * self.d_model * s

    def flops_per_token_megatron(self, seq_len: int | None = None) -> int:
        """Megatron convention with the causal mask halving attention: ``6*N + 6*L*d*S``."""
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.params_nonembedding + 6 * self.n_layers * self.d_model * s

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "params": self.params,
            "params_nonembedding": self.params_nonembedding,
            "flops_per_token": self.flops_per_token(),
            "flops_per_token_megatron": self.flops_per_token_megatron(),
        }


# GPT-2 / GPT-3 shapes (Radford et al. 2019; Brown et al. 2020, table 2.1). The LM head is
# untied from the token embedding so that tensor and pipeline parallel can place it freely;
# that is why `small` counts ~163M parameters rather than GPT-2's 124M.
_VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 128 (nanoGPT)
SIZES: dict[str, ModelSize] = {
    s.name: s
    for s in (
        ModelSize("tiny", n_layers=4, d_model=128, n_heads=4, seq_len=128, vocab_size=256, device_kind="cpu"),
        ModelSize("mini", n_layers=6, d_model=256, n_heads=8, seq_len=256, vocab_size=1024, device_kind="cpu"),
        ModelSize("small", n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
        ModelSize("medium", n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
        ModelSize("large", n_layers=24, d_model=1536, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
        ModelSize("xl", n_layers=24, d_model=2048, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
    )
}


def get_size(name: str) -> ModelSize:
    """Look a size up by name; the error lists the valid names."""
    try:
        return SIZES[name]
    except KeyError:
        raise ValueError(f"unknown size {name!r}; choose from {', '.join(SIZES)}") from None
