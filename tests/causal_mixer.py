"""A second architecture in one file: a causal MLP-Mixer language model (docs/model.md).

It shows what a new architecture adds to this repository: a config dataclass with the fields of
``train.architecture.ArchitectureConfig`` and a ``build()`` method, and a model with the members of
``train.architecture.Architecture``. Nothing else changes: the module, the callbacks, FSDP and the
loggers use it through that protocol (tests/unit/test_architecture.py trains it). Its config is
``tests/causal_mixer.yaml``.

Per block (pre-norm, residual stream of width ``d_model``)::

    x = x + W[:L, :L].tril() @ LayerNorm(x)     # token mixing: position i mixes positions <= i (causal)
    x = x + MLP(LayerNorm(x))                    # channel mixing, per position

followed by a final LayerNorm and an LM head tied to the token embedding. Shapes: B batch, L sequence
length, D = d_model, V = vocab_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class MixerConfig:
    vocab_size: int = 100352
    d_model: int = 32
    n_layers: int = 2
    mlp_hidden: int = 64
    max_seq_len: int = 128
    """The token-mixing matrices are max_seq_len x max_seq_len: the context cannot grow after training."""
    doc_mask: bool = False
    """Not supported: token mixing sees every earlier position of the row."""
    loss_impl: str = "plain"
    activation_checkpointing: bool = False

    def build(self) -> CausalMixer:
        return CausalMixer(self)


class CausalMixer(nn.Module):
    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(MixerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def forward(self, input_ids: Tensor, doc_index: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        x = self.tok_emb(input_ids)  # [B, L, D]
        for block in self.blocks:
            x = block(x)
        logits = (self.norm(x) @ self.tok_emb.weight.T).float()  # [B, L, V], the head tied to the embedding
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding else n

    def param_summary(self) -> str:
        per_block = sum(p.numel() for p in self.blocks[0].parameters())
        return (f"{self.num_params():,} parameters: embeddings {self.tok_emb.weight.numel():,} (tied with the "
                f"LM head), {self.config.n_layers} mixer blocks x {per_block:,}")

    def flops_per_token(self, seq_len: int) -> float:
        """6 x (channel-MLP matrices + LM head) per token, plus token mixing: 2 x seq_len x D multiply-adds
        forward per token and layer (the full L x L matrix counted), 3x for forward + backward."""
        cfg = self.config
        n_matmul = sum(b.mlp[0].weight.numel() + b.mlp[2].weight.numel() for b in self.blocks)
        n_matmul += cfg.d_model * cfg.vocab_size
        return 6.0 * n_matmul + 6.0 * cfg.n_layers * seq_len * cfg.d_model


class MixerBlock(nn.Module):
    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(config.d_model)
        self.token_mix = nn.Parameter(torch.randn(config.max_seq_len, config.max_seq_len) * 0.02)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, config.mlp_hidden), nn.GELU(),
                                 nn.Linear(config.mlp_hidden, config.d_model))

    def forward(self, x: Tensor) -> Tensor:
        L = x.shape[1]
        mix = self.token_mix[:L, :L].tril()  # [L, L]: row i weighs positions 0..i
        x = x + torch.einsum("ij,bjd->bid", mix, self.token_norm(x))
        return x + self.mlp(self.mlp_norm(x))
