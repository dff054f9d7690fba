"""Document masking through flex_attention (one BlockMask per forward) against the dense-mask SDPA reference.

What runs on CPU here (torch 2.13, CPU wheel):

- flex_attention forward on CPU, eager: the unfused math implementation, which applies the mask_mod to
  every score and ignores the BlockMask's tiles. So the tiles are checked separately, against the dense
  mask, with the semantics the GPU kernel gives them (empty: skipped; full: no mask; partial: mask_mod).
- flex_attention backward on CPU is refused by torch's input check (``_validate_device``), not by the math:
  the gradient tests switch that check off and run torch's eager (math) flex backward. That checks the
  model's wiring (mask_mod, GQA, layout, checkpointing), not the compiled CUDA kernel, which is not run
  here (no GPU).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train.model as model_module
from train.model import (
    GPT,
    Attention,
    ModelConfigError,
    document_block_mask,
    document_causal_mask,
    document_mask_mod,
    load_model_config,
    rope_tables,
)

flex = pytest.importorskip("torch.nn.attention.flex_attention")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
TINY = load_model_config(CONFIG_DIR / "tiny.yaml")


@pytest.fixture(autouse=True)
def _quiet_unfused_flex_warning():
    # flex_attention warns once that, uncompiled, it is the unfused implementation: expected on CPU.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    """Let torch's eager flex_attention run its backward on CPU (see the module docstring)."""
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)


def packed_doc_index(lengths_per_row: list[list[int]], ids_per_row: list[list[int]] | None = None) -> torch.Tensor:
    """doc_index [B, L] (int32, as the packer makes it) of rows packed with documents of the given lengths."""
    rows = []
    for r, lengths in enumerate(lengths_per_row):
        ids = ids_per_row[r] if ids_per_row else range(len(lengths))
        rows.append(torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in zip(ids, lengths)]))
    return torch.stack(rows)


# Several documents per row, a one-token document, a row that is one document, document boundaries on
# and off the tile edges, and ids that are neither sorted nor from 0 (the mask compares ids, nothing more).
DOC_40 = packed_doc_index(
    [[10, 30], [3, 5, 8, 1, 23], [40]],
    [[0, 1], [7, 2, 9, 4, 5], [3]],
)


def block_mask_as_dense(bm) -> torch.Tensor:
    """What the flex kernel computes with ``bm``, as a boolean [B, 1, Q, KV] mask: a pair is allowed when its
    tile is listed full, or listed partial and the mask_mod allows it; unlisted tiles are skipped."""
    q_block, kv_block = bm.BLOCK_SIZE
    q_len, kv_len = bm.seq_lengths
    B = bm.kv_num_blocks.shape[0]
    assert bm.kv_num_blocks.shape[1] == 1  # one mask for every head
    q_idx = torch.arange(q_len).view(-1, 1)
    kv_idx = torch.arange(kv_len).view(1, -1)
    out = torch.zeros(B, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(B):
        by_mod = bm.mask_mod(torch.tensor(b), torch.tensor(0), q_idx, kv_idx)  # [Q, KV]
        for qb in range(bm.kv_num_blocks.shape[2]):
            rows = slice(qb * q_block, (qb + 1) * q_block)
            for kb in bm.kv_indices[b, 0, qb, : bm.kv_num_blocks[b, 0, qb]].tolist():
                cols = slice(kb * kv_block, (kb + 1) * kv_block)
                out[b, 0, rows, cols] = by_mod[rows, cols]
            for kb in bm.full_kv_indices[b, 0, qb, : bm.full_kv_num_blocks[b, 0, qb]].tolist():
                out[b, 0, rows, kb * kv_block : (kb + 1) * kv_block] = True
    return out


def tile_reduce(mask: torch.Tensor, block: int, how) -> torch.Tensor:
    """[B, 1, L, L] bool -> [B, nq, nk]: ``how`` (torch.any / torch.all) over each block x block tile."""
    B, _, L, _ = mask.shape
    n = -(-L // block)
    out = torch.zeros(B, n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            out[:, i, j] = how(mask[:, 0, i * block : (i + 1) * block, j * block : (j + 1) * block].flatten(1), dim=1)
    return out


# --- the mask itself --------------------------------------------------------------------------------


def test_mask_mod_evaluated_densely_equals_dense_mask():
    B, L = DOC_40.shape
    by_mod = flex.create_mask(document_mask_mod(DOC_40), B, 1, L, L, device="cpu")
    assert torch.equal(by_mod, document_causal_mask(DOC_40))


@pytest.mark.parametrize("block", [8, 16, 128])
def test_block_mask_tiles_equal_dense_mask(block):
    """The BlockMask lists exactly the tiles with an allowed pair, marks full exactly the all-allowed tiles,
    and what the kernel computes from it is the dense mask. L = 40 is not a multiple of 16 or 128."""
    dense = document_causal_mask(DOC_40)
    bm = document_block_mask(DOC_40, block_size=block)
    assert torch.equal(block_mask_as_dense(bm), dense)

    listed = bm.to_dense().bool().squeeze(1)  # [B, nq, nk]: partial or full
    assert torch.equal(listed, tile_reduce(dense, block, torch.any))  # no allowed pair's tile is skipped
    if 40 % block == 0:
        full = torch.zeros_like(listed)
        for b in range(listed.shape[0]):
            for qb in range(listed.shape[1]):
                full[b, qb, bm.full_kv_indices[b, 0, qb, : bm.full_kv_num_blocks[b, 0, qb]]] = True
        assert torch.equal(full, tile_reduce(dense, block, torch.all))
    if block == 8:  # the document structure is what makes it sparse: fewer tiles than causal alone
        causal_tiles = 5 * 6 // 2
        assert (listed.sum(dim=(1, 2)) < causal_tiles).tolist() == [True, True, False]


# --- one attention layer: flex vs dense SDPA ----------------------------------------------------------


def attention_pair(n_heads: int, n_kv_heads: int):
    cfg = replace(TINY, d_model=64, n_heads=n_heads, n_kv_heads=n_kv_heads, doc_mask=True)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(*DOC_40.shape, cfg.d_model, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_tables(DOC_40.shape[1], cfg.head_dim, cfg.rope_theta)
    return attn, x, cos.unsqueeze(0), sin.unsqueeze(0)


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
def test_flex_forward_equals_dense_sdpa(n_heads, n_kv_heads):
    attn, x, cos, sin = attention_pair(n_heads, n_kv_heads)
    with torch.no_grad():  # torch's own CPU path, nothing switched off
        ref = attn(x, cos, sin, document_causal_mask(DOC_40))
        out = attn(x, cos, sin, document_block_mask(DOC_40, block_size=16))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2)], ids=["mha", "gqa2"])
def test_flex_gradients_equal_dense_sdpa(n_heads, n_kv_heads, flex_cpu_backward):
    attn, x, cos, sin = attention_pair(n_heads, n_kv_heads)
    grads = []
    for mask in (document_causal_mask(DOC_40), document_block_mask(DOC_40, block_size=16)):
        xi = x.clone().requires_grad_()
        out = attn(xi, cos, sin, mask)
        attn.zero_grad()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        grads.append([out.detach(), xi.grad] + [p.grad.clone() for p in attn.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# --- the whole model ----------------------------------------------------------------------------------

L_MODEL = 300  # three 128-token tiles: empty, partial and full tiles all occur
DOC_300 = packed_doc_index([[100, 60, 140], [5, 250, 45], [300]])
MODEL_OVERRIDES = dict(max_seq_len=512, n_heads=4, n_kv_heads=2, qk_norm=True, doc_mask=True)
SMALL_VOCAB = 1024
"""For the bf16 autocast cases: attention is the subject, and a CPU without native bf16 takes ~60x
longer for the 100k-vocab projection in bf16 (scripts/bench_train.py --cpu-precision)."""


def model_with(impl: str, **overrides) -> GPT:
    torch.manual_seed(0)  # the same weights for every impl: doc_mask_impl adds no parameter
    return GPT(replace(TINY, **{**MODEL_OVERRIDES, "doc_mask_impl": impl, **overrides}))


def model_inputs(vocab_size: int = TINY.vocab_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (3, L_MODEL + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[DOC_300 != torch.roll(DOC_300, -1, dims=1)] = -100  # no label across a boundary
    # Positions restart at every document start, as the data path's position reset gives them.
    starts = torch.ones_like(DOC_300, dtype=torch.bool)
    starts[:, 1:] = DOC_300[:, 1:] != DOC_300[:, :-1]
    idx = torch.arange(L_MODEL).expand(3, -1)
    start_of = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return ids[:, :-1], targets, idx - start_of


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_model_logits_and_losses_equal_flex_vs_dense(autocast, monkeypatch):
    vocab = SMALL_VOCAB if autocast else TINY.vocab_size
    ids, targets, positions = model_inputs(vocab)
    out = {}
    for impl in ("dense", "flex"):
        model = model_with(impl, vocab_size=vocab).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if impl == "flex":  # the flex path must not build the dense mask
                monkeypatch.setattr(model_module, "document_causal_mask", _no_dense_mask)
            logits = model(ids, doc_index=DOC_300, position_ids=positions)
            losses = model(ids, doc_index=DOC_300, position_ids=positions, targets=targets)
        out[impl] = (logits, losses)
    atol = 2e-2 if autocast else 1e-5  # bf16: one rounding step of logits below 1 (seen: 4e-3)
    torch.testing.assert_close(out["flex"][0], out["dense"][0], atol=atol, rtol=0)
    torch.testing.assert_close(out["flex"][1], out["dense"][1], atol=atol, rtol=0)


def _no_dense_mask(doc_index):
    raise AssertionError("the flex path built a dense [B, 1, L, L] mask")


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation_checkpointing"])
def test_model_training_step_equal_flex_vs_dense(ckpt, flex_cpu_backward):
    """Loss and every parameter gradient of a training forward/backward, with and without activation
    checkpointing (the BlockMask passes through torch.utils.checkpoint and is reused on recompute)."""
    ids, targets, positions = model_inputs()
    results = {}
    for impl in ("dense", "flex"):
        model = model_with(impl, activation_checkpointing=ckpt).train()
        losses = model(ids, doc_index=DOC_300, position_ids=positions, targets=targets)
        loss = losses.sum() / (targets != -100).sum()
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_d, grads_d), (loss_f, grads_f) = results["dense"], results["flex"]
    torch.testing.assert_close(loss_f, loss_d, atol=1e-6, rtol=0)
    for name, g in grads_d.items():
        torch.testing.assert_close(grads_f[name], g, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl,doc_mask", [("auto", False), ("dense", True), ("flex", True)],
                         ids=["causal_sdpa", "dense_mask_sdpa", "flex"])
def test_under_bf16_autocast_every_attention_kernel_gets_one_dtype(impl, doc_mask, monkeypatch, flex_cpu_backward):
    """With model.qk_norm the norm's fp32 gain made q and k fp32 while v stayed bf16 under autocast: CPU
    kernels took the mix, the compiled CUDA flex_attention refuses it. Every kernel the model calls (causal
    SDPA, dense-mask SDPA, flex) must see q, k and v in one dtype (bf16), forward and backward."""
    seen = []

    def spy(kernel):
        def call(q, k, v, *args, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return kernel(q, k, v, *args, **kwargs)
        return call

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy(F.scaled_dot_product_attention))
    monkeypatch.setattr(model_module, "flex_attention", spy(model_module.flex_attention))
    ids, targets, positions = (t[1:2, :136] for t in model_inputs(SMALL_VOCAB))  # two documents, two tiles
    model = model_with(impl, doc_mask=doc_mask, n_layers=1, vocab_size=SMALL_VOCAB).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(ids, doc_index=DOC_300[1:2, :136], position_ids=positions, targets=targets)
    losses.sum().backward()
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_auto_picks_flex_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not model_with("auto").uses_flex(cpu)
    assert model_with("auto").uses_flex(cuda)
    assert model_with("flex").uses_flex(cpu)
    assert not model_with("dense").uses_flex(cuda)


def test_without_doc_mask_attention_is_plain_causal(monkeypatch):
    """doc_mask off: no mask of either kind is built, whatever doc_mask_impl says (SDPA's is_causal path)."""
    monkeypatch.setattr(model_module, "document_causal_mask", _no_dense_mask)
    monkeypatch.setattr(model_module, "document_block_mask", _no_dense_mask)
    ids, _, _ = model_inputs()
    with torch.no_grad():
        logits = model_with("flex", doc_mask=False).eval()(ids[:, :20], doc_index=DOC_300[:, :20])
    assert logits.shape == (3, 20, TINY.vocab_size)


def test_flex_cpu_backward_is_refused_by_torch_unless_switched_off():
    """Why ``auto`` is dense on CPU. If a later torch allows this, the choice can be revisited."""
    ids, targets, _ = model_inputs()
    model = model_with("flex").train()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(ids[:, :20], doc_index=DOC_300[:, :20], targets=targets[:, :20])


# --- config ---------------------------------------------------------------------------------------------


def test_unknown_doc_mask_impl_names_the_field():
    with pytest.raises(ModelConfigError, match=r"model\.doc_mask_impl must be one of 'auto', 'flex', 'dense'"):
        replace(TINY, doc_mask_impl="varlen")


def test_unknown_doc_mask_impl_in_yaml_names_file_and_field(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text((CONFIG_DIR / "tiny.yaml").read_text() + "doc_mask_impl: Flex\n")
    with pytest.raises(ModelConfigError, match=r"m\.yaml: model\.doc_mask_impl must be one of .*got 'Flex'"):
        load_model_config(path)



# --- under torch.compile (the GPU path: compiled model, or compiled helpers around an eager one) ----------


def test_compiled_model_traces_mask_and_flex_into_one_graph():
    """torch.compile of the whole model (module.py's compile) traces create_block_mask and every layer's
    flex_attention, through activation checkpointing, without a graph break: a break would run
    create_block_mask eagerly (a dense [B, 1, L, L] evaluation) and flex_attention unfused. Traced only
    (torch._dynamo.explain), not compiled by inductor: that takes minutes on CPU."""
    ids, _, positions = model_inputs()
    model = model_with("flex", activation_checkpointing=True).train()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids, doc_index=DOC_300, position_ids=positions)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
def test_compiled_helpers_equal_eager_without_recompiling():
    """The compiled create_block_mask and flex_attention that an uncompiled model uses on CUDA, here on CPU
    (forward only): the same BlockMask as eager, attention equal to dense SDPA, and a new batch's doc_index
    (a new mask_mod closure) reuses the compiled graphs (about 20 s on CPU, mostly compiling)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    make, attend = model_module._compiled(flex.create_block_mask), model_module._compiled(flex.flex_attention)
    B, H, K, L, Dh = 2, 4, 2, 256, 16
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        doc = torch.sort(torch.randint(0, 4, (B, L), generator=g), dim=1).values.int()
        compiled_bm = make(document_mask_mod(doc), B, None, L, L, device=doc.device, BLOCK_SIZE=128)
        eager_bm = document_block_mask(doc)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(compiled_bm, name), getattr(eager_bm, name)), name
        q = torch.randn(B, H, L, Dh, generator=g)
        k, v = torch.randn(B, K, L, Dh, generator=g), torch.randn(B, K, L, Dh, generator=g)
        out = attend(q, k, v, block_mask=compiled_bm, enable_gqa=True)
        ref = F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1), attn_mask=document_causal_mask(doc)
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one each, no recompile
