"""Linear + cross-entropy in token chunks: per-token losses without a [tokens, vocab] fp32 tensor.

The plain path (``F.cross_entropy(lm_head(h).float(), t, reduction='none')``) keeps fp32 logits, their
log-softmax and both gradients for all N tokens at once: 26 GB each at 32 x 2048 tokens and a 100,352-row
vocabulary. Here the head matmul and the softmax run on ``chunk_tokens`` tokens at a time; forward saves
only the inputs and one fp32 logsumexp per token, and backward recomputes each chunk's logits. That costs
one extra head matmul but is exact for any per-token ``grad_output`` (which the per-source loss needs:
the losses are returned per token, so the gradient weights are known only in backward).

Why not a library kernel: the per-source loss needs per-token losses *and* a gradient that is exact for
whatever per-token weights reach backward. Liger-Kernel's fused linear cross-entropy computes the
gradient inside its forward for a reduced loss, and with ``reduction="none"`` gives wrong gradients under
per-token weights (linkedin/Liger-Kernel#968). Cut-cross-entropy gets this right but needs Triton (GPU
only) and another wheel. This path is pure PyTorch, the same on CPU (tested) and GPU, and torch.compile
fuses each chunk's softmax.

Numerics follow the plain path: the matmul runs in the autocast dtype (bf16 under bf16-mixed), the
softmax in fp32, padding vocabulary rows take part in the softmax, targets equal to ``ignore_index``
get loss 0 and no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""F.cross_entropy's default, which the training targets use for tokens without a label."""

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""fp32 bytes of one chunk's [chunk_tokens, V] logits: 668 tokens at V = 100,352. A few such
tensors live at once (logits, probabilities, their bf16 gradient), so the loss peaks near 1 GB."""


def default_chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 [chunk, vocab_size] tensor stays within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def head_matmul(hidden: Tensor, weight: Tensor) -> Tensor:
    """Logits [n, V] of ``hidden`` [n, D] in their dtype. A module-level function so that a test can
    wrap it and check that no call sees more than ``chunk_tokens`` rows."""
    return hidden @ weight.t()


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute in here: the autocast dtype when autocast is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets, reduction='none')`` in chunks of tokens; fp32 result [N]."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int,
                ignore_index: int) -> Tensor:
        dtype = _compute_dtype(hidden)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.chunk_tokens, ctx.ignore_index = chunk_tokens, ignore_index
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            lse = torch.empty_like(losses)
            for start in range(0, h.shape[0], chunk_tokens):
                sl = slice(start, start + chunk_tokens)
                logits = head_matmul(h[sl], w).float()  # [c, V]
                lse[sl] = torch.logsumexp(logits, dim=-1)
                t = targets[sl]
                valid = t != ignore_index
                target_logit = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                losses[sl] = torch.where(valid, lse[sl] - target_logit, 0.0)
        ctx.save_for_backward(h, w, targets, lse)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        h, w, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk_tokens
        grad_h = torch.empty(h.shape, dtype=ctx.hidden_dtype, device=h.device)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # summed over chunks in fp32
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], chunk):
                sl = slice(start, start + chunk)
                t = targets[sl]
                valid = t != ctx.ignore_index
                # d loss_i / d logits_i = softmax_i - onehot(t_i), times the caller's weight g_i.
                grad_logits = torch.exp(head_matmul(h[sl], w).float() - lse[sl].unsqueeze(1))  # [c, V]
                rows = torch.arange(grad_logits.shape[0], device=h.device)
                grad_logits[rows, t.clamp(min=0)] -= 1.0
                grad_logits *= torch.where(valid, grad_losses[sl].float(), 0.0).unsqueeze(1)
                # The plain path casts the fp32 logits gradient back to the matmul dtype, then runs
                # the head's backward matmuls in that dtype.
                grad_logits = grad_logits.to(h.dtype)
                grad_h[sl] = (grad_logits @ w).to(ctx.hidden_dtype)
                grad_w += (grad_logits.t() @ h[sl]).float()
        return grad_h, grad_w.to(ctx.weight_dtype), None, None, None


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int | None = None,
                                 ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token fp32 losses [N] of ``hidden`` [N, D] (after the final norm) under the head ``weight``
    [V, D] (the embedding matrix when tied) against ``targets`` [N]. ``chunk_tokens`` None = the size
    whose fp32 [chunk, V] logits take :data:`DEFAULT_CHUNK_BYTES`."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, D] and targets [N], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index)
