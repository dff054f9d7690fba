"""train/loss.py: the chunked linear + cross-entropy matches the plain fp32 path, in values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import train.loss as loss_mod
from train.loss import chunked_linear_cross_entropy, default_chunk_tokens

N, D, V = 37, 16, 203


def inputs(seed: int = 0, ignore_every: int = 5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::ignore_every] = -100
    grad_out = torch.rand(N, generator=g) * 3  # arbitrary per-token weights, as the per-source loss gives
    return hidden, weight, targets, grad_out


def losses_and_grads(fn, hidden, weight, targets, grad_out, autocast: bool):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = fn(h, w, targets)
    (losses * grad_out).sum().backward()
    return losses.detach(), h.grad, w.grad


def plain(h, w, targets):
    return F.cross_entropy(F.linear(h, w).float(), targets, reduction="none")


@pytest.mark.parametrize("chunk", [1, 5, 16, N, 100])
@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_matches_plain_path(chunk, autocast):
    hidden, weight, targets, grad_out = inputs()
    ref = losses_and_grads(plain, hidden, weight, targets, grad_out, autocast)
    got = losses_and_grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_tokens=chunk),
                           hidden, weight, targets, grad_out, autocast)
    assert got[0].dtype == torch.float32 and got[0].shape == (N,)
    assert (got[0][targets == -100] == 0).all()
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)


def test_tied_weight_gets_both_gradients():
    """A tied head: the embedding lookup and the head both add into the one matrix's gradient."""
    hidden, weight, targets, grad_out = inputs(seed=1)
    ids = torch.randint(0, V, (N,))
    grads = []
    for fn in (plain, lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_tokens=7)):
        w = weight.clone().requires_grad_()
        h = F.embedding(ids, w) + hidden
        (fn(h, w, targets) * grad_out).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


def test_head_never_sees_more_than_chunk_tokens(monkeypatch):
    """Structural bound: no [N, V] logits, forward or backward; N = 37 tokens, chunks of 8."""
    rows = []
    real = loss_mod.head_matmul

    def spy(h, w):
        rows.append(h.shape[0])
        return real(h, w)

    monkeypatch.setattr(loss_mod, "head_matmul", spy)
    hidden, weight, targets, grad_out = inputs()
    losses_and_grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_tokens=8),
                     hidden, weight, targets, grad_out, autocast=True)
    assert max(rows) == 8 and sum(rows) == 2 * N  # once in forward, once (recomputed) in backward


def test_default_chunk_fits_the_budget():
    assert default_chunk_tokens(100352) == 668
    assert default_chunk_tokens(10**12) == 1


def test_memory_estimate_counts_what_autograd_saves():
    """The estimate's saved-activation and loss terms equal the bytes autograd saves for backward on a
    tiny model under bf16 autocast (weights excluded: they are counted as parameters), within 5%."""
    from dataclasses import replace

    from train.memory import block_saved_bytes_per_token, estimate_peak_memory, loss_bytes
    from train.model import GPT, ModelConfig

    cfg = replace(ModelConfig(), vocab_size=512, d_model=128, n_layers=2, n_heads=2, ffn_hidden=384, max_seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    saved: dict[int, int] = {}
    B, L = 2, 48

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        # weights and their per-step bf16 casts (the tied head's transposed) are not per-token activations
        rope_table = t.shape[-2:] == (L, cfg.head_dim // 2)
        if not {tuple(t.shape), tuple(reversed(t.shape))} & weight_shapes and not rope_table:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (B, L))
    for loss in ("plain", "chunked"):
        saved.clear()
        model.config.loss_impl = loss
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, targets=ids)
        est = estimate_peak_memory(cfg, B, L, loss=loss)
        expected = est["block_activations"] + est["loss_saved"]
        assert abs(sum(saved.values()) - expected) / expected < 0.05, (loss, sum(saved.values()), expected)
    assert block_saved_bytes_per_token(ModelConfig()) == 59464
    assert loss_bytes(ModelConfig(), 1, "plain")[0] > 100 * loss_bytes(ModelConfig(), 1, "chunked")[0]
