"""The optimizer (``model.optim``): a config that builds it, selected by ``name``.

``OptimConfig.build(named_parameters, lr)`` returns the torch optimizer; the memory estimate asks
:meth:`OptimConfig.state_bytes` (train/memory.py) and the resume rule asks :data:`OptimConfig.MAY_CHANGE`
(train/resume.py): nothing else in the repository knows which optimizer runs. To add one, add its name
and its branch in ``build`` and ``state_bytes`` (docs/training.md, "Swapping the optimizer").

- ``adamw``: AdamW, weight decay on matrices (embeddings included), none on norm gains;
- ``muon``: ``torch.optim.Muon`` for the 2-D hidden weight matrices, AdamW (as above) for the rest: the
  embeddings, the output head (``adamw_params``) and the norm gains; one optimizer object holds both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch


@dataclass
class OptimConfig:
    """The optimizer; the learning rate itself is the LR schedule's (``model.lr``)."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw; or muon: Muon for the 2-D hidden matrices, AdamW for the embeddings, the head and the norms."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's betas."""
    weight_decay: float = 0.1
    """Applied to matrices (embeddings included), not to norm gains; Muon's matrices too."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    fused: Optional[bool] = None
    """Fused AdamW kernel; None = wherever the device supports it (CUDA, and CPU in recent torch)."""
    momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    ns_steps: int = 5
    """Muon's Newton-Schulz iterations."""
    adjust_lr_fn: Optional[Literal["original", "match_rms_adamw"]] = "match_rms_adamw"
    """Muon's LR adjustment: match_rms_adamw scales its update to AdamW's RMS, so one LR schedule serves both."""
    adamw_params: tuple[str, ...] = ("emb", "head")
    """Muon: 2-D parameters whose name contains one of these stay with AdamW (the embeddings, the output head)."""

    MAY_CHANGE: ClassVar[dict[str, str]] = {
        "fused": "the fused or the for-each AdamW kernel: the same state, the same update",
    }
    """Fields a resume may change (applied and logged, train/resume.py); every other one must match the
    checkpoint, whose optimizer state was written by it (a changed ``name`` is refused naming the key)."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # a checkpoint's hparams hold a list
        self.adamw_params = tuple(self.adamw_params)

    def hparams(self) -> dict:
        """Plain types, for a checkpoint loaded with ``torch.load(weights_only=True)``."""
        return {**vars(self), "betas": list(self.betas), "adamw_params": list(self.adamw_params)}

    def muon_matrix(self, name: str, p: torch.Tensor) -> bool:
        """Whether Muon updates this parameter (always False for ``adamw``)."""
        return self.name == "muon" and p.dim() == 2 and not any(s in name for s in self.adamw_params)

    def build(self, named_parameters: Iterable[tuple[str, torch.Tensor]], lr: float) -> torch.optim.Optimizer:
        """The optimizer over ``named_parameters`` (a module's ``named_parameters()``) at base LR ``lr``."""
        named = list(named_parameters)
        fused = self.fused
        if fused is None:
            fused = all(p.device.type in ("cuda", "cpu") for _, p in named)
        muon = [p for n, p in named if self.muon_matrix(n, p)]
        decay = [p for n, p in named if p.dim() >= 2 and not self.muon_matrix(n, p)]
        no_decay = [p for _, p in named if p.dim() < 2]
        adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=self.betas, eps=self.eps, fused=fused,
        )
        if self.name == "adamw":
            return adamw
        return MuonWithAdamW([
            torch.optim.Muon([{"params": muon}], lr=lr, weight_decay=self.weight_decay, momentum=self.momentum,
                             ns_steps=self.ns_steps, adjust_lr_fn=self.adjust_lr_fn),
            adamw,
        ])

    def state_bytes(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Bytes of optimizer state for these parameters (fp32): AdamW's two moments (8 per parameter),
        Muon's momentum (4 per parameter of a Muon matrix). Works on meta tensors."""
        return sum(p.numel() * (4 if self.muon_matrix(n, p) else 8) for n, p in named_parameters)


class MuonWithAdamW(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one: one ``param_groups`` list (each part's groups,
    in order, so one LR scheduler drives them all) and one ``state``, so the standard ``state_dict`` and
    ``load_state_dict`` save and restore every part's state bitwise."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([g for part in parts for g in part.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = 0
        for part in self.parts:  # load_state_dict replaces the groups and the state: each part reads them here
            n = len(part.param_groups)
            part.param_groups, part.state = self.param_groups[first:first + n], self.state
            first += n
            part.step()
        return loss
