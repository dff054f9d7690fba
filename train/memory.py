"""Per-GPU peak-memory estimate of one training step, before any memory is allocated.

Counted from what the code keeps, not fitted: the parameters and their state, plus the tensors autograd
saves for backward under bf16 autocast (counted with ``saved_tensors_hooks`` on this repo's block, see
test_memory_estimate_counts_what_autograd_saves in tests/unit/test_loss.py), plus the loss path's transients.
"""

from __future__ import annotations

from train.loss import default_chunk_tokens
from train.model import ModelConfig
from train.optim import OptimConfig

GB = 1e9


def block_saved_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes one block saves for backward per token under bf16 autocast (MHA; GQA saves a little less).

    fp32: the block input and the mid-block residual (pow/mul in RMSNorm) and both norm outputs: 4 x 4D.
    bf16: the six matmul inputs autocast casts (wq, wk, wv, wo, w1, w3 each cast separately): 6 x 2D;
    SDPA's q, k, v and output: 4 x 2D; the SwiGLU w1 and w3 outputs, silu output and the product: 4 x 2F;
    SDPA's fp32 logsumexp (4 per head) and the two RMSNorm rsqrt values (2 x 4).
    At the 350M block (D 1024, F 2816, 16 heads) that is 36D + 8F + 4H + 8 = 59,464 bytes (58.1 KiB).
    """
    d, f, h = cfg.d_model, cfg.ffn_hidden, cfg.n_heads
    return 36 * d + 8 * f + 4 * h + 8


def loss_bytes(cfg: ModelConfig, tokens: int, loss: str) -> tuple[int, int]:
    """(saved for backward, extra transient at the start of the loss backward) of the head + loss.

    plain: the fp32 log-softmax [N, V] saved (and the head's bf16 input); backward adds the fp32 log-softmax
    gradient, the fp32 logits gradient and its bf16 cast (4V + 4V + 2V per token).
    chunked: the bf16 hidden [N, D] and an fp32 logsumexp per token; backward holds an fp32 [V, D] weight
    gradient, its bf16 per-chunk term, the hidden gradient and about three [chunk, V] tensors.
    """
    v, d = cfg.vocab_size, cfg.d_model
    if loss == "plain":
        return tokens * (2 * d + 4 * v), tokens * 10 * v
    if loss != "chunked":
        raise ValueError(f"loss must be 'chunked' or 'plain' (got {loss!r})")
    chunk = min(tokens, default_chunk_tokens(v))
    return tokens * (2 * d + 4 + 8), 6 * v * d + 4 * tokens * d + chunk * v * (4 + 4 + 2)


def estimate_peak_memory(config: ModelConfig, micro_batch: int, seq_len: int, loss: str = "chunked",
                         activation_checkpointing: bool = False, precision: str = "bf16-mixed",
                         optim: OptimConfig | None = None) -> dict[str, float]:
    """Estimated peak bytes per GPU of one DDP training step, by part, with ``total``.

    Parameters and gradients are fp32 (8 bytes per parameter), the optimizer's state is what ``optim``
    (train/optim.py; default AdamW: 8 bytes) says; under bf16-mixed
    autocast also keeps a bf16 copy of every matmul weight for the step (2 bytes). The peak is taken at
    the start of backward: every saved activation plus the loss backward's transients.
    Only ``bf16-mixed`` is modelled.
    """
    if precision != "bf16-mixed":
        raise ValueError(f"only bf16-mixed is modelled (got {precision!r})")
    import torch

    from train.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    n_params = model.num_params()
    tokens = micro_batch * seq_len
    per_block = block_saved_bytes_per_token(config)
    d = config.d_model
    if activation_checkpointing:  # each block keeps its fp32 input; one block is recomputed at a time
        blocks = tokens * (config.n_layers * 4 * d + per_block)
    else:
        blocks = tokens * config.n_layers * per_block
    blocks += tokens * 8 * d  # final norm: its fp32 input (the last block's output) and output
    saved, transient = loss_bytes(config, tokens, loss)
    parts = {
        "params_grads": 8.0 * n_params,
        "optimizer_state": float((optim or OptimConfig()).state_bytes(model.named_parameters())),
        "bf16_weight_copies": 2.0 * n_params,
        "block_activations": float(blocks),
        "loss_saved": float(saved),
        "loss_backward_transient": float(transient),
    }
    parts["total"] = sum(parts.values())
    return parts


def memory_table(parts: dict[str, float], device_bytes: float | None = None) -> str:
    """The estimate by part, in GB, with the device's memory when known."""
    rows = [f"  {name:<24} {value / GB:8.1f} GB" for name, value in parts.items() if name != "total"]
    rows.append(f"  {'estimated peak per GPU':<24} {parts['total'] / GB:8.1f} GB")
    if device_bytes:
        rows.append(f"  {'device memory':<24} {device_bytes / GB:8.1f} GB")
    return "\n".join(rows)


FIT_FRACTION = 0.92
"""Share of the device's memory the estimate may use: the caching allocator's fragmentation, the CUDA
context, NCCL buffers and torch.compile's workspace live in the rest."""


def check_fits(config: ModelConfig, micro_batch: int, seq_len: int, device_bytes: float, *,
               precision: str = "bf16-mixed", optim: OptimConfig | None = None) -> dict[str, float]:
    """Refuse (ValueError naming the knobs) a micro-batch whose estimated peak exceeds the device.

    Returns the estimate. The knobs, cheapest first: the chunked loss (``model.loss_impl``), activation
    checkpointing (``model.activation_checkpointing``: ~25% more compute), a smaller ``data.batch_size``
    with a larger ``trainer.accumulate_grad_batches`` (same global batch, more steps per update)."""
    parts = estimate_peak_memory(config, micro_batch, seq_len, loss=config.loss_impl,
                                 activation_checkpointing=config.activation_checkpointing, precision=precision,
                                 optim=optim)
    budget = FIT_FRACTION * device_bytes
    if parts["total"] <= budget:
        return parts
    fixes = []
    if config.loss_impl != "chunked":
        alt = estimate_peak_memory(config, micro_batch, seq_len, loss="chunked",
                                   activation_checkpointing=config.activation_checkpointing, optim=optim)["total"]
        fixes.append(f"model.loss_impl chunked ({alt / GB:.1f} GB)")
    if not config.activation_checkpointing:
        alt = estimate_peak_memory(config, micro_batch, seq_len, loss=config.loss_impl,
                                   activation_checkpointing=True, optim=optim)["total"]
        fixes.append(f"model.activation_checkpointing true ({alt / GB:.1f} GB)")
    mb = micro_batch // 2
    while mb >= 1:
        alt = estimate_peak_memory(config, mb, seq_len, loss=config.loss_impl,
                                   activation_checkpointing=config.activation_checkpointing, optim=optim)["total"]
        if alt <= budget:
            fixes.append(f"data.batch_size {mb} with trainer.accumulate_grad_batches x{micro_batch // mb} "
                         f"({alt / GB:.1f} GB)")
            break
        mb //= 2
    raise ValueError(
        f"data.batch_size {micro_batch} x seq_len {seq_len}: estimated peak {parts['total'] / GB:.1f} GB per GPU "
        f"exceeds {FIT_FRACTION:.0%} of the device's {device_bytes / GB:.1f} GB (train/memory.py); "
        f"turn one knob: {'; or '.join(fixes) or 'a smaller model'}\n{memory_table(parts, device_bytes)}"
    )


def memory_plan(cfg, label: str, micro_batch: int, seq_len: int, gpu_gib: float,
                optim: OptimConfig | None = None) -> str:
    """The estimated peak memory per GPU (train/memory.py) of model ``cfg`` (a ModelConfig; ``label`` names
    it) at its micro-batch and longest sequence, for each loss path with and without activation
    checkpointing; the start-up check refuses what does not fit the GPU it runs on."""
    budget = FIT_FRACTION * gpu_gib * 2**30
    lines = [f"memory per GPU (DDP, bf16-mixed, {(optim or OptimConfig()).name}; model {label}, "
             f"data.batch_size {micro_batch} x {seq_len} tokens; fits = under {FIT_FRACTION:.0%} of "
             f"{gpu_gib:g} GiB, --gpu-memory-gib):"]
    for loss in ("chunked", "plain"):
        for ckpt in (False, True):
            total = estimate_peak_memory(cfg, micro_batch, seq_len, loss=loss, activation_checkpointing=ckpt,
                                         optim=optim)["total"]
            chosen = loss == cfg.loss_impl and ckpt == cfg.activation_checkpointing
            lines.append(f"  model.loss_impl {loss:<8} activation_checkpointing {str(ckpt).lower():<5} "
                         f"{total / GB:7.1f} GB  {'fits' if total <= budget else 'DOES NOT FIT'}"
                         + ("   <- this config" if chosen else ""))
    return "\n".join(lines)
