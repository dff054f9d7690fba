"""What the training code needs of a model: the contract a second architecture implements.

``train/model.py``'s GPT is one architecture; the module, the callbacks, FSDP, the loggers and the
memory plan only use what is listed here (docs/model.md says how to add another: one new file that
defines a config dataclass with a ``build()`` method and the model, plus a model YAML)::

    config = MyConfig(...)               # ArchitectureConfig: a dataclass of plain values
    model = build_model(config)          # config.build() (GPT for train.model.ModelConfig)
    losses = model(input_ids, doc_index=doc_index, targets=targets)    # [B, L] fp32, no reduction
    logits = model(input_ids)                                            # [B, L, V] fp32

docs/model.md's tables say which file reads which member. ``train/memory.py`` (the memory plan) and
``train/tools/export.py`` (the Hugging Face Llama export) are GPT's own: they read its shape and names.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from train.model import GPT, ModelConfig, ModelConfigError


@runtime_checkable
class ArchitectureConfig(Protocol):
    """A model's configuration: a dataclass of plain values (it is saved in checkpoints as ``vars(config)``)."""

    vocab_size: int
    """Token ids are in ``[0, vocab_size)`` (cl100k: 100,352 with padding)."""
    max_seq_len: int
    """The longest sequence the model takes; the schedule's final ``seq_len`` must not exceed it."""
    doc_mask: bool
    """Whether the model wants ``doc_index`` (the packed document of each token) in its forward."""
    loss_impl: str
    """How the per-token loss is computed (``chunked`` / ``plain`` for GPT); printed with the memory plan."""
    activation_checkpointing: bool
    """Recompute each block in backward instead of keeping its activations."""


@runtime_checkable
class Architecture(Protocol):
    """A model the training code can train: an ``nn.Module`` with the members below."""

    config: Any
    """Its :class:`ArchitectureConfig`."""
    blocks: nn.ModuleList
    """The repeated layers: FSDP2 shards each one as a unit (train/parallel.py ``shard_per_block``)."""

    def __call__(self, input_ids: Tensor, doc_index: Tensor | None = None,
                 targets: Tensor | None = None) -> Tensor:
        """Per-token fp32 losses [B, L] (no reduction, ``-100`` targets give 0) with ``targets``;
        fp32 logits [B, L, V] without."""
        ...

    def parameters(self, recurse: bool = True) -> Any:
        """``nn.Module.parameters``: matrices (dim >= 2) get weight decay, vectors do not."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``: the numerator of MFU."""
        ...

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, shared tensors once; ``non_embedding`` leaves out the token embedding."""
        ...

    def param_summary(self) -> str:
        """One line on what the parameter count is made of (printed at start-up)."""
        ...


@runtime_checkable
class BuildsArchitecture(Protocol):
    """A new architecture's config: an :class:`ArchitectureConfig` that builds its model.

    Also the type a config file can name with ``class_path`` (jsonargparse accepts a class that
    implements a protocol with methods: ``model: {class_path: my_arch.MyConfig, init_args: {...}}``)."""

    def build(self) -> Any:
        """The model, an :class:`Architecture` (``Any`` here: jsonargparse's protocol check wants the
        implementation's return type to equal this one)."""
        ...


def build_model(config: ArchitectureConfig) -> Architecture:
    """The model ``config`` describes: ``config.build()``, or GPT for :class:`train.model.ModelConfig`."""
    if isinstance(config, ModelConfig):
        return GPT(config)
    build = getattr(config, "build", None)
    if not callable(build):
        raise ModelConfigError(f"model: {type(config).__name__} has no build() method; an architecture's config "
                               "builds its model (docs/model.md)")
    model = build()
    if not isinstance(model, Architecture):
        missing = [name for name in ("blocks", "config", "flops_per_token", "num_params", "param_summary")
                   if not hasattr(model, name)]
        raise ModelConfigError(f"model: {type(config).__name__}.build() returned a {type(model).__name__} without "
                               f"{', '.join(missing)} (train/architecture.py lists what a model provides)")
    return model
