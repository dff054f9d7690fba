"""train/model.py: shapes, masking, positions, parameter and FLOP counts, init, config loading."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from train.model import GPT, ModelConfig, ModelConfigError, load_model_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
TINY = load_model_config(CONFIG_DIR / "tiny.yaml")
ATOL = 1e-5


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(TINY, **overrides)).eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, length), generator=g)


def hand_param_count(c: ModelConfig) -> int:
    """Embedding (+ LM head when untied) + per block (q, k, v, o, SwiGLU, 2 norms [+ q/k norms]) + final norm."""
    kv_dim = c.kv_heads * c.head_dim
    block = 2 * c.d_model * c.d_model + 2 * c.d_model * kv_dim + 3 * c.d_model * c.ffn_hidden + 2 * c.d_model
    if c.qk_norm:
        block += 2 * c.head_dim
    emb = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    return emb + c.n_layers * block + c.d_model


# --- forward: shapes, masks, positions -------------------------------------------------------------


def test_logits_shape_and_dtype():
    model = tiny_model(doc_mask=True)
    ids = random_ids(2, 16)
    doc = torch.zeros_like(ids)
    logits = model(ids, doc_index=doc, position_ids=torch.arange(16).expand(2, 16))
    assert logits.shape == (2, 16, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("doc_mask", [False, True])
def test_future_tokens_do_not_change_past_logits(doc_mask):
    model = tiny_model(doc_mask=doc_mask)
    ids = random_ids(2, 20)
    changed = ids.clone()
    changed[:, 12:] = random_ids(2, 8, seed=2)
    doc = torch.zeros_like(ids)
    a, b = model(ids, doc_index=doc), model(changed, doc_index=doc)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=ATOL, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_document_mask_isolates_later_document():
    ids = random_ids(1, 20)
    changed = ids.clone()
    changed[:, :7] = random_ids(1, 7, seed=3)  # rewrite the first document only
    doc = torch.tensor([[0] * 7 + [1] * 13])

    masked = tiny_model(doc_mask=True)
    torch.testing.assert_close(
        masked(ids, doc_index=doc)[:, 7:], masked(changed, doc_index=doc)[:, 7:], atol=ATOL, rtol=0
    )

    unmasked = tiny_model(doc_mask=False)  # doc_index is ignored: the later document sees the earlier one
    assert not torch.allclose(unmasked(ids, doc_index=doc)[:, 7:], unmasked(changed, doc_index=doc)[:, 7:], atol=ATOL)


def test_document_mask_with_one_document_equals_causal_attention():
    ids = random_ids(2, 24)
    causal = tiny_model(doc_mask=False)(ids)
    masked = tiny_model(doc_mask=True)(ids, doc_index=torch.full_like(ids, 5))
    torch.testing.assert_close(masked, causal, atol=ATOL, rtol=0)


def test_position_reset_makes_packed_document_match_row_start():
    model = tiny_model(doc_mask=True)
    doc_a, doc_b = random_ids(1, 9, seed=4), random_ids(1, 6, seed=5)
    alone = model(doc_a, doc_index=torch.zeros_like(doc_a))  # doc A at the start of a row

    packed = torch.cat([doc_b, doc_a], dim=1)  # doc A after a boundary
    doc = torch.tensor([[0] * 6 + [1] * 9])
    restarted = torch.cat([torch.arange(6), torch.arange(9)]).unsqueeze(0)
    torch.testing.assert_close(model(packed, doc_index=doc, position_ids=restarted)[:, 6:], alone, atol=ATOL, rtol=0)

    # RoPE scores depend only on position differences, so under the mask A's logits match even
    # without the reset (positions 6..14), up to rounding. The reset matters without the mask.
    torch.testing.assert_close(model(packed, doc_index=doc)[:, 6:], alone, atol=ATOL, rtol=0)


def test_position_ids_are_used():
    model = tiny_model(doc_mask=False)  # A attends to B, so restarting A's positions changes distances
    ids = random_ids(1, 15)
    restarted = torch.cat([torch.arange(6), torch.arange(9)]).unsqueeze(0)
    assert not torch.allclose(model(ids, position_ids=restarted)[:, 6:], model(ids)[:, 6:], atol=ATOL)
    shifted = torch.arange(15).unsqueeze(0) + 100  # a uniform shift changes no distance
    torch.testing.assert_close(model(ids, position_ids=shifted), model(ids), atol=ATOL, rtol=0)


def test_doc_mask_without_doc_index_is_refused():
    with pytest.raises(ValueError, match="doc_index"):
        tiny_model(doc_mask=True)(random_ids(1, 8))


def test_sequence_longer_than_max_seq_len_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model()(random_ids(1, TINY.max_seq_len + 1))


def test_gqa_and_qk_norm_run_and_stay_causal():
    model = tiny_model(n_heads=4, n_kv_heads=2, qk_norm=True)
    assert model.num_params() == hand_param_count(model.config)
    ids = random_ids(2, 12)
    changed = ids.clone()
    changed[:, 8:] = 7
    a, b = model(ids), model(changed)
    assert a.shape == (2, 12, TINY.vocab_size)
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=ATOL, rtol=0)


def test_activation_checkpointing_gives_same_loss_and_grads():
    ids = random_ids(2, 16)
    results = []
    for ckpt in (False, True):
        model = tiny_model(activation_checkpointing=ckpt).train()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb)


# --- parameters, init, FLOPs -----------------------------------------------------------------------


def test_tied_embeddings_share_one_tensor():
    tied, untied = tiny_model(), tiny_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == TINY.vocab_size * TINY.d_model
    assert tied.num_params(non_embedding=True) == untied.num_params(non_embedding=True)


def test_350m_parameter_count_on_meta_device():
    with torch.device("meta"):
        model = GPT(ModelConfig())
    cfg = model.config
    assert model.num_params() == hand_param_count(cfg) == 359_703_552
    assert round(model.num_params() / 1e6, 1) == 359.7
    assert model.num_params(non_embedding=True) == 20 * 12_847_104 + 1024
    assert model.param_summary() == (
        "359,703,552 (359.7M) parameters: embeddings 102.8M (tied with the LM head), "
        "20 blocks x 12.85M, final norm 1,024"
    )


def test_350m_flops_per_token_at_2048():
    with torch.device("meta"):
        model = GPT(ModelConfig())
    d, layers, vocab, ffn = 1024, 20, 100352, 2816
    n_matmul = layers * (4 * d * d + 3 * d * ffn) + d * vocab  # block matrices + LM head
    expected = 6 * n_matmul + 12 * layers * d * 2048
    assert model.flops_per_token(2048) == expected == 2_661_285_888


def test_residual_projections_get_depth_scaled_init():
    cfg = replace(TINY, vocab_size=512, d_model=256, n_layers=8, n_heads=4, ffn_hidden=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for block in model.blocks:
        assert block.attn.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.mlp.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.attn.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
        assert block.mlp.w1.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
        assert torch.equal(block.attn_norm.weight, torch.ones(cfg.d_model))
    assert model.tok_emb.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)


def test_init_weights_materialises_a_meta_model():
    with torch.device("meta"):
        model = GPT(TINY)
    model.to_empty(device="cpu")  # parameters and RoPE tables now hold garbage
    torch.manual_seed(0)
    model.init_weights()
    reference = GPT(TINY).eval()
    torch.manual_seed(0)
    reference.init_weights()
    assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    ids = random_ids(1, 8)
    torch.testing.assert_close(model.eval()(ids), reference(ids))


@pytest.mark.slow
def test_350m_adamw_step_on_cpu():
    # Built on meta and initialised once: skips nn.Linear's own init of 360M weights (seconds on CPU).
    with torch.device("meta"):
        model = GPT(load_model_config(CONFIG_DIR / "350m.yaml"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.1, fused=True
    )  # fused: ~2.5x faster on CPU
    ids = random_ids(1, 33)
    before = model.blocks[0].attn.wq.weight.detach().clone()

    logits = model(ids[:, :-1])  # [1, 32, V]
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()

    assert torch.isfinite(loss)
    # Random init predicts roughly uniformly over the vocabulary.
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), abs=1.0)
    assert not torch.equal(model.blocks[0].attn.wq.weight, before)


# --- config validation and YAML --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 1000}, "model.d_model (1000) must be divisible by model.n_heads (16)"),
        ({"d_model": 48, "n_heads": 16}, "model.d_model / model.n_heads = 3"),
        ({"n_kv_heads": 5}, "model.n_heads (16) must be divisible by model.n_kv_heads (5)"),
        ({"n_layers": 0}, "model.n_layers must be a positive integer"),
        ({"vocab_size": 100352.0}, "model.vocab_size must be a positive integer"),
        ({"n_kv_heads": True}, "model.n_kv_heads must be a positive integer"),
        ({"norm_eps": "1e-5"}, "model.norm_eps must be a positive number (got the string '1e-5'"),
        ({"init_std": -0.02}, "model.init_std must be a positive number"),
        ({"doc_mask": "yes"}, "model.doc_mask must be true or false"),
    ],
)
def test_validation_errors_name_the_field(overrides, message):
    with pytest.raises(ModelConfigError) as excinfo:
        ModelConfig(**overrides)
    assert message in str(excinfo.value)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_model_yaml_loads_and_states_its_parameter_count(path):
    cfg = load_model_config(path)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == hand_param_count(cfg)
    assert f"{model.num_params():,}" in path.read_text()  # the comment's count is the real one


def test_350m_yaml_is_the_dataclass_default():
    assert load_model_config(CONFIG_DIR / "350m.yaml") == ModelConfig()


def test_unknown_yaml_key_names_file_and_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("d_model: 64\nn_layer: 2\n")
    with pytest.raises(ModelConfigError, match=r"typo\.yaml: unknown key\(s\) \['n_layer'\]"):
        load_model_config(path)


def test_bad_yaml_value_names_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("norm_eps: 1e-5\n")  # YAML 1.1: a string
    with pytest.raises(ModelConfigError, match=r"bad\.yaml: model\.norm_eps must be a positive number"):
        load_model_config(path)


# --- per-token losses: chunked (default) vs plain --------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_matches_plain_loss_and_grads(autocast):
    """forward(targets=...) gives the same per-token losses and parameter gradients on both loss paths
    (tied embeddings: the head matrix is the embedding), unlabelled tokens included."""
    ids = random_ids(2, 17)
    targets = ids[:, 1:].clone()
    targets[:, ::4] = -100
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for impl in ("plain", "chunked"):
        model = tiny_model(loss_impl=impl).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = model(ids[:, :-1], targets=targets)
        assert losses.shape == targets.shape and losses.dtype == torch.float32
        (losses * weights).sum().backward()
        results.append((losses.detach(), [p.grad for p in model.parameters()]))
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, **tol)


def test_hidden_is_what_the_head_reads():
    model = tiny_model()
    ids = random_ids(2, 9)
    h = model.hidden(ids)
    assert h.shape == (2, 9, TINY.d_model)
    torch.testing.assert_close(model(ids), F.linear(h, model.head_weight).float())
    assert model.head_weight is model.tok_emb.weight
