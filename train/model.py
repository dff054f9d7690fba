"""A Llama-style decoder-only transformer: the model this repo pretrains.

Read top to bottom: :class:`ModelConfig` (the knobs), :class:`GPT` (the whole model), then the blocks
it is made of (:class:`Block`, :class:`Attention`, :class:`SwiGLU`, :class:`RMSNorm`), then pure helpers
(rotary tables, config checks, YAML loading).

Architecture, per block (pre-norm, residual stream of width ``d_model``)::

    x = x + Attention(RMSNorm(x))      # RoPE on q/k, optional GQA and per-head q/k RMSNorm
    x = x + SwiGLU(RMSNorm(x))         # w2(silu(w1 x) * w3 x)

followed by a final RMSNorm and an LM head tied to the token embedding. No biases and no dropout
anywhere: biases buy nothing at this scale and dropout hurts single-epoch pretraining.

Attention kernels (docs/real-run.md). Without ``doc_mask``: plain causal SDPA (``is_causal=True``,
the flash kernel). With it (block-diagonal causal: a token sees only earlier tokens of its own packed
document), ``doc_mask_impl`` picks ``flex`` (``auto`` on CUDA: flex_attention with ONE ``BlockMask`` per
forward shared by every layer, compiled on CUDA, empty tiles skipped, GQA in the kernel) or ``dense``
(``auto`` elsewhere: a [B, 1, L, L] boolean mask through SDPA, the reference and the CPU path, since
flex_attention has no backward on CPU). Flex rather than flash-attn's varlen kernel: it ships with
torch, takes the [B, H, L, Dh] layout as is, needs no sorted or contiguous document ids, and has a
math fallback the tests run on CPU.

Shapes: B = batch, L = sequence length, D = d_model, H = n_heads, K = n_kv_heads, Dh = D / H head dim,
V = vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from train.loss import IGNORE_INDEX, chunked_linear_cross_entropy

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5 has no flex_attention: doc_mask_impl auto then means dense
    BlockMask = create_block_mask = flex_attention = None


DOC_MASK_IMPLS = ("auto", "flex", "dense")
"""Values of ``ModelConfig.doc_mask_impl``."""

FLEX_BLOCK_SIZE = 128
"""Tile size of the flex BlockMask (the flex_attention kernels' default): a tile of 128 queries x 128 keys
is skipped, computed without the mask (every pair allowed) or computed with it."""


class ModelConfigError(ValueError):
    """A bad model config: the message names the field (or file) and what is wrong. The model does not
    import the data path, so this is its own error; the CLI reports it like ``data.errors.ConfigError``."""


@dataclass
class ModelConfig:
    """Model shape and initialisation. The defaults are the 350M model of ``configs/model/350m.yaml``."""

    vocab_size: int = 100352
    """Embedding rows: cl100k_base's 100,277 tokens padded up to a multiple of 128 (100,352) so the
    LM-head matmul tiles cleanly on tensor cores. The 75 padding rows are never targets."""
    d_model: int = 1024
    """Width of the residual stream."""
    n_layers: int = 20
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads; the head dimension is ``d_model / n_heads`` and must be even (RoPE rotates pairs)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide ``n_heads``. None = ``n_heads`` (plain MHA)."""
    ffn_hidden: int = 2816
    """SwiGLU hidden size (about 8/3 * d_model, rounded up to a multiple of 256, keeps the FFN at
    the parameter count of a 4 * d_model GELU MLP)."""
    max_seq_len: int = 2048
    """Longest sequence (and largest position id + 1) the rotary tables cover."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies are ``rope_theta ** (-2i / Dh)``."""
    norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    tie_embeddings: bool = True
    """Share the token-embedding matrix with the LM head (saves V * D = 102.8M parameters at 350M)."""
    qk_norm: bool = False
    """RMSNorm on q and k per head before RoPE (OLMo 2 / Qwen3 style); guards against attention-logit growth."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix; ``wo`` and ``w2`` get ``init_std / sqrt(2 * n_layers)``."""
    doc_mask: bool = False
    """Mask attention at document boundaries: tokens see only earlier tokens of their own document.
    ``GPT.forward`` then needs ``doc_index``."""
    doc_mask_impl: str = "auto"
    """How the document mask reaches attention (only used with ``doc_mask``): ``flex`` (flex_attention
    with one BlockMask per forward: no dense mask, empty tiles skipped; compiled on CUDA), ``dense``
    (a [B, 1, L, L] boolean mask through SDPA: the reference; rules out the flash kernel) or ``auto``
    (flex on CUDA, dense elsewhere: torch 2.13's flex_attention has no backward on CPU)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (while training) to save memory."""
    loss_impl: str = "chunked"
    """How ``GPT.forward(..., targets=...)`` computes per-token losses: ``chunked`` (train/loss.py: the
    head and softmax in token chunks, never a [tokens, vocab] fp32 tensor) or ``plain`` (full fp32
    logits then ``F.cross_entropy``: the reference, 79-92 GB of loss tensors at 32 x 2048)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """``n_kv_heads`` with None resolved to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def validate(self) -> None:
        """Refuse unusable shapes before any memory is allocated; messages name the ``model.`` field."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is not None:
            _check_positive_int("n_kv_heads", self.n_kv_heads)
        for name in ("rope_theta", "norm_eps", "init_std"):
            _check_positive_float(name, getattr(self, name))
        for name in ("tie_embeddings", "qk_norm", "doc_mask", "activation_checkpointing"):
            _check_bool(name, getattr(self, name))
        if self.doc_mask_impl not in DOC_MASK_IMPLS:
            allowed = ", ".join(map(repr, DOC_MASK_IMPLS))
            raise ModelConfigError(f"model.doc_mask_impl must be one of {allowed} (got {self.doc_mask_impl!r})")
        if self.loss_impl not in ("chunked", "plain"):
            raise ModelConfigError(f"model.loss_impl must be 'chunked' or 'plain' (got {self.loss_impl!r})")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"model.d_model / model.n_heads = {self.head_dim} is the head dimension and must be even "
                "(RoPE rotates pairs of dimensions)"
            )
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )


class GPT(nn.Module):
    """Decoder-only transformer: token ids in, next-token logits out.

    ``forward(input_ids, doc_index=None, position_ids=None, targets=None)``: ``input_ids`` [B, L] with
    L <= ``max_seq_len``; ``doc_index`` [B, L], each token's document (any ids, equal within a document;
    required with ``config.doc_mask``, ignored otherwise); ``position_ids`` [B, L], RoPE positions (default
    ``0..L-1``; restarting them at each document changes only rounding under ``doc_mask``); ``targets``
    [B, L], next-token ids (``-100``: no label). Returns fp32 logits [B, L, V], or with ``targets`` fp32
    per-token losses [B, L] (0 where unlabelled; ``config.loss_impl``), computed inside ``forward`` so that a
    compiled, DDP- or FSDP-wrapped model runs it with its head weight in place. :meth:`hidden` gives the
    final-norm hidden states alone.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)  # tied in init_weights
        # RoPE cos/sin for every position, [max_seq_len, Dh/2]. Non-persistent: they are a pure
        # function of the config, so checkpoints stay free of them and never go stale. fp32, and they
        # stay fp32 under bf16 autocast (casting the whole model with .to(bf16) would round them).
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and fill the RoPE tables.

        Called by ``__init__``; call it again after materialising a model built on the meta device
        (``model.to_empty(device=...)``), which leaves parameters and buffers uninitialised and the
        embeddings untied.

        Every matrix is N(0, init_std). The two projections that write into the residual stream
        (attention ``wo``, MLP ``w2``) use ``init_std / sqrt(2 * n_layers)``: the stream is a sum of
        2 * n_layers such writes, so this keeps its variance at init independent of depth (GPT-2, OLMo).
        With tied embeddings the shared matrix gets the embedding's N(0, init_std).
        """
        cfg = self.config
        if cfg.tie_embeddings:  # here, not in __init__: to_empty() unties them (above)
            self.lm_head.weight = self.tok_emb.weight
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith((".wo", ".w2")) else cfg.init_std
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @property
    def head_weight(self) -> Tensor:
        """The LM-head matrix [V, D]: the token embedding when tied."""
        return self.lm_head.weight

    def forward(self, input_ids: Tensor, doc_index: Tensor | None = None, position_ids: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor:
        x = self.hidden(input_ids, doc_index=doc_index, position_ids=position_ids)  # [B, L, D]
        if targets is None:
            # Under bf16 autocast the head computes in bf16; the loss wants fp32 logits.
            return self.lm_head(x).float()  # [B, L, V]
        if self.config.loss_impl == "plain":
            logits = self.lm_head(x).float()  # [B, L, V]
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        return _chunked_loss(x.flatten(0, 1), self.head_weight, targets.flatten()).view_as(targets)

    def hidden(self, input_ids: Tensor, doc_index: Tensor | None = None, position_ids: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, [B, L, D]: what the LM head reads."""
        cfg = self.config
        L = input_ids.shape[1]
        if L > cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds model.max_seq_len ({cfg.max_seq_len})")

        if position_ids is None:
            cos, sin = self.rope_cos[:L], self.rope_sin[:L]  # [L, Dh/2], same for every row
        else:
            cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]  # [B, L, Dh/2]
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [1, L, Dh/2] or [B, 1, L, Dh/2]: broadcast over heads

        # Mask choice, fixed by the config and the device (so compiled graphs never branch on data).
        mask: Tensor | BlockMask | None = None
        if cfg.doc_mask:
            if doc_index is None:
                raise ValueError("model.doc_mask is on: pass doc_index [B, L] to forward")
            if self.uses_flex(input_ids.device):
                mask = document_block_mask(doc_index)  # built once, shared by every layer
            else:
                mask = document_causal_mask(doc_index)  # [B, 1, L, L] bool

        x = self.tok_emb(input_ids)  # [B, L, D]
        for block in self.blocks:
            if cfg.activation_checkpointing and self.training:
                # Keep only the block's input; rerun the block during backward.
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        return self.norm(x)  # [B, L, D]

    def uses_flex(self, device: torch.device) -> bool:
        """Whether document masking runs through flex_attention on ``device`` (``model.doc_mask_impl``)."""
        impl = self.config.doc_mask_impl
        if impl == "flex" and flex_attention is None:
            raise ModelConfigError(f"model.doc_mask_impl: flex needs torch >= 2.5 (this is {torch.__version__})")
        return impl == "flex" or (impl == "auto" and device.type == "cuda" and flex_attention is not None)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, shared (tied) tensors counted once.

        ``non_embedding=True`` leaves out the token embedding and, when untied, the LM head: what is
        left is the blocks and the final norm (Kaplan et al.'s N).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def param_summary(self) -> str:
        """One line saying what the parameter count is made of, e.g.
        ``359,703,552 (359.7M) parameters: embeddings 102.8M (tied with the LM head), 20 blocks x 12.85M,
        final norm 1,024``.
        """
        cfg = self.config
        emb = self.tok_emb.weight.numel()
        per_block = sum(p.numel() for p in self.blocks[0].parameters())
        parts = [f"embeddings {_short(emb)}" + (" (tied with the LM head)" if cfg.tie_embeddings else "")]
        if not cfg.tie_embeddings:
            parts.append(f"LM head {_short(self.lm_head.weight.numel())}")
        parts.append(f"{cfg.n_layers} blocks x {_short(per_block)}")
        parts.append(f"final norm {self.norm.weight.numel():,}")
        total = self.num_params()
        return f"{total:,} ({_short(total)}) parameters: " + ", ".join(parts)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``, for throughput and MFU.

        PaLM (Chowdhery et al. 2022, appendix B)::

            6 * N + 12 * n_layers * d_model * seq_len

        - ``N`` counts the parameters that take part in a matmul: every weight matrix of the blocks
          (wq, wk, wv, wo, w1, w2, w3) plus the LM head (``d_model * vocab_size``, counted even when
          tied: the head matmul runs either way). The embedding lookup and the norms do no matmul.
          Each such parameter costs 2 FLOPs (multiply-add) forward and 4 backward: 6 per token.
        - ``12 * n_layers * d_model * seq_len`` is attention itself (QK^T and AV: 2 matmuls of
          2 * d_model * seq_len FLOPs each per token, times 3 for forward + backward). It counts the
          full L x L score matrix, as PaLM does, although causal kernels skip the upper half.

        Activation-checkpointing recomputation is not counted (it is overhead, not model FLOPs).
        """
        cfg = self.config
        n_matmul = sum(p.numel() for p in self.blocks.parameters() if p.dim() == 2)
        n_matmul += cfg.d_model * cfg.vocab_size
        return 6.0 * n_matmul + 12.0 * cfg.n_layers * cfg.d_model * seq_len


class Block(nn.Module):
    """Pre-norm transformer block: attention then SwiGLU, each added to the residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)  # [B, L, D]
        return x + self.mlp(self.mlp_norm(x))  # [B, L, D]


class Attention(nn.Module):
    """Causal self-attention with RoPE, optional grouped-query attention and q/k RMSNorm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
        """``mask``: None (causal), a dense boolean [B, 1, L, L] mask, or a flex ``BlockMask``."""
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.head_dim)  # [B, L, H, Dh]
        k = self.wk(x).view(B, L, self.n_kv_heads, self.head_dim)  # [B, L, K, Dh]
        v = self.wv(x).view(B, L, self.n_kv_heads, self.head_dim)  # [B, L, K, Dh]
        # Heads first, the layout SDPA expects.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H or K, L, Dh]
        # q/k norm (if on) acts on the raw per-head vectors, before RoPE mixes their dimensions.
        # Under bf16 autocast the q/k RMSNorm's fp32 gain makes q and k fp32 while v stays bf16: attention
        # kernels take one dtype (the compiled flex_attention refuses a mix), so q and k follow v.
        q = apply_rope(self.q_norm(q), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k), cos, sin).to(v.dtype)
        if BlockMask is not None and isinstance(mask, BlockMask):
            # Block-sparse document masking; the kernel maps query head h to kv head h // (H / K) itself.
            y = _flex_attention(q, k, v, mask, enable_gqa=self.n_kv_heads != self.n_heads)  # [B, H, L, Dh]
            y = y.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim)  # [B, L, D]
            return self.wo(y)  # [B, L, D]
        if self.n_kv_heads != self.n_heads:
            # GQA: query head h reads kv head h // (H / K). Repeating k/v costs memory only here,
            # inside the step; the cache-size saving of GQA matters at inference, not in pretraining.
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)  # [B, H, L, Dh]
            v = v.repeat_interleave(rep, dim=1)  # [B, H, L, Dh]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, L, Dh]
        else:  # the dense reference and CPU path (no flash kernel with a mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, L, Dh]
        y = y.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim)  # [B, L, D]
        return self.wo(y)  # [B, L, D]


class SwiGLU(nn.Module):
    """Gated MLP ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020), as in Llama."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # value
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # back to the residual stream

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [.., hidden] -> [.., D]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (Zhang & Sennrich 2019): LayerNorm without
    the mean subtraction and the bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Mean of squares in fp32: in bf16 it loses digits over a thousand elements.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


# ---------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------


def rope_tables(
    max_seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``position * theta ** (-2i / head_dim)``, each [max_seq_len, head_dim / 2], fp32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # [Dh/2]
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)  # [T]
    angles = torch.outer(positions, inv_freq)  # [T, Dh/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[i], x[i + Dh/2])`` of ``x`` [B, heads, L, Dh] by the angles in cos/sin
    ([1, L, Dh/2] or [B, 1, L, Dh/2]) (the "rotate half" layout of GPT-NeoX / HF Llama; Meta's interleaved pairs
    are the same model up to a fixed permutation of the head dimensions). Computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, heads, L, Dh/2] each
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, heads, L, Dh]
    return rotated.type_as(x)


@torch.compiler.disable
def _chunked_loss(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """train/loss.py's chunked loss, kept out of torch.compile graphs: its Python loop over chunks would
    be unrolled into the graph (about 100 chunks at 32 x 2048), and the matmuls gain nothing from fusion."""
    return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX)


def document_causal_mask(doc_index: Tensor) -> Tensor:
    """Boolean attention mask from a per-token document index [B, L]: True where token i may attend
    to token j, i.e. ``j <= i and doc[j] == doc[i]`` (block-diagonal causal). Returns [B, 1, L, L],
    broadcast over heads. The diagonal is always True, so no row is fully masked."""
    L = doc_index.shape[1]
    same_doc = doc_index.unsqueeze(2) == doc_index.unsqueeze(1)  # [B, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_index.device).tril()  # [L, L]
    return (same_doc & causal).unsqueeze(1)  # [B, 1, L, L]


def document_mask_mod(doc_index: Tensor):
    """flex_attention ``mask_mod`` of :func:`document_causal_mask`: query ``q_idx`` of row ``b`` may attend to
    key ``kv_idx`` iff ``kv_idx <= q_idx`` and both tokens carry the same ``doc_index`` [B, L] value."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (doc_index[b, q_idx] == doc_index[b, kv_idx])

    return mask_mod


def document_block_mask(doc_index: Tensor, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """The flex ``BlockMask`` of the block-diagonal causal mask of ``doc_index`` [B, L], shared by all heads:
    which ``block_size`` tiles are empty (skipped), full (no mask evaluated) or partial, plus the mask_mod.
    Compiled on CUDA (never a dense [B, L, L] mask); on CPU it evaluates the mask_mod densely once."""
    B, L = doc_index.shape
    make = create_block_mask
    if doc_index.is_cuda and not torch.compiler.is_compiling():
        make = _compiled(create_block_mask)  # inside a compiled model it is traced into the graph instead
    return make(document_mask_mod(doc_index), B, None, L, L, device=doc_index.device, BLOCK_SIZE=block_size)


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, enable_gqa: bool) -> Tensor:
    """flex_attention, compiled on CUDA (eager it is an unfused reference that materialises every score);
    eager elsewhere (CPU: forward only in torch 2.13). Inside a compiled model it is traced into the graph."""
    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        fn = _compiled(flex_attention)
    return fn(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


_COMPILED: dict = {}


def _compiled(fn):
    """``torch.compile(fn)``, made once per function on first use (not at import: compiling is lazy, but
    importing torch._dynamo is not free)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a ``configs/model/*.yaml`` file: a flat mapping of :class:`ModelConfig` fields.
    Missing keys take the dataclass defaults; unknown keys and bad values raise :class:`ModelConfigError`
    naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ModelConfigError(f"{path}: model config file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ModelConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a mapping of model fields (d_model: 1024, ...)")
    known = [f.name for f in fields(ModelConfig)]
    unknown = [key for key in raw if key not in known]
    if unknown:
        raise ModelConfigError(f"{path}: unknown key(s) {unknown}; valid keys are {known}")
    try:
        return ModelConfig(**raw)
    except ModelConfigError as e:
        raise ModelConfigError(f"{path}: {e}") from None


def _short(n: int) -> str:
    """4 significant digits with a K/M/B suffix: 359703552 -> '359.7M', 12847104 -> '12.85M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `n_layers: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"model.{name} must be a positive integer (got {value!r})")


def _check_positive_float(name: str, value: object) -> None:
    # YAML 1.1 reads `1e-5` (no dot) as a string; say so, since that is the usual cause.
    if isinstance(value, str):
        raise ModelConfigError(f"model.{name} must be a positive number (got the string {value!r}; write e.g. 1.0e-5)")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise ModelConfigError(f"model.{name} must be a positive number (got {value!r})")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ModelConfigError(f"model.{name} must be true or false (got {value!r})")
