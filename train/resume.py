"""The resume rule: what a resume must keep from its checkpoint, and what it may change.

- the ``model:`` settings (:func:`resume_differences`, :func:`check_resume`): the model's shape and math and
  the optimizer's settings must match; the few in :data:`MAY_CHANGE` and the optimizer's
  ``OptimConfig.MAY_CHANGE`` (train/optim.py) are applied and logged;
- the schedule the run trains with (:func:`schedule_fingerprint`, :func:`check_schedule_unchanged`, which
  the DataModule calls when it loads a checkpoint's data state);
- the ``data:`` settings that decide the chunks the data order is built on (:func:`data_settings`,
  :func:`check_data_settings`): a change is named with its two values, before the corpus fingerprint
  (which they change too) is compared; another tokenizer (``data.tokenizer``) is refused whatever the flags;
- the one change a decay branch makes (:func:`check_branch`, ``run.branch``: another mixture from the
  checkpoint's step on).

docs/config.md ("resuming") is the user's view of this file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from data.errors import ConfigError
from data.schedules import ScheduleConfig
from data.tokenizer import CL100K_IDENTITY
from train.optim import OptimConfig

log = logging.getLogger("wellmixed")

MAY_CHANGE = {
    "compile": "torch.compile or eager: the same computation",
    "on_nonfinite": "what a non-finite loss does from now on (stop, or skip the step)",
    "log_every_n_steps": "set from run.log_every_n_steps",
    "model.activation_checkpointing": "recompute activations in backward: memory, not the result",
    "model.loss_impl": "chunked or plain loss: the same per-token losses",
    "model.doc_mask_impl": "how the document mask reaches attention: the same mask",
}
"""``model:`` settings a resume may change: applied from the command line and config files, each change
logged. Every other ``model:`` setting (the model's shape and math, the optimizer's settings, which its
state restores) must match the checkpoint; a difference is refused by name (docs/config.md)."""


def _flat(hparams: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in hparams.items():
        if key.startswith("_"):
            continue
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def resume_differences(saved: dict, requested: dict, lr_may_change: bool = False) -> tuple[list[tuple], list[tuple]]:
    """(refused, applied): ``(key, checkpoint value, asked value)`` of the ``model:`` settings that differ
    between a checkpoint's hyper-parameters and the run's (keys as in the config: ``model.d_model`` is
    ``--model.model.d_model``). An ``optim`` field missing on either side (a checkpoint from before the field)
    counts as its default; any other setting the checkpoint does not record (newer than it) is not compared.
    ``model.lr`` may change with ``run.allow_changed_schedule`` (``lr_may_change``), like the schedule."""
    default_optim = OptimConfig().hparams()
    saved = _flat({**saved, "optim": {**default_optim, **(saved.get("optim") or {})}})
    requested = _flat({**requested, "optim": {**default_optim, **(requested.get("optim") or {})}})
    may_change = {*MAY_CHANGE, *(f"model.{k}" for k in MAY_CHANGE), *(f"optim.{k}" for k in OptimConfig.MAY_CHANGE)}
    refused, applied = [], []
    for key in sorted(saved):
        old, new = saved[key], requested.get(key)
        if old != new:
            allowed = key in may_change or f"model.{key}" in may_change or lr_may_change and key.startswith("lr.")
            (applied if allowed else refused).append((key, old, new))
    return refused, applied


def check_resume(path: str, saved: dict | None, requested: dict, lr_may_change: bool = False) -> list[str]:
    """Refuse (ConfigError, one line naming each key) a resume whose must-match settings differ from the
    checkpoint's; return the allowed changes, one ``model.KEY: checkpoint V -> W`` line each, for the log."""
    if not saved:
        return []
    refused, applied = resume_differences(saved, requested, lr_may_change)
    if refused:
        diffs = "; ".join(f"model.{k} is {old!r} in the checkpoint, {new!r} here" for k, old, new in refused)
        fix = " ".join(f"--model.{k} {_flag_value(old)}" for k, old, _ in refused)
        raise ConfigError(f"--ckpt_path {path}: {diffs}. A resume keeps the checkpoint's model and optimizer: "
                          f"give {fix} (or the configs it was trained with), or start a new run in another "
                          f"--run.dir (docs/config.md, resuming)")
    return [f"model.{k}: checkpoint {old!r} -> {new!r}" for k, old, new in applied]


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value).lower() \
        if isinstance(value, bool) else str(value)


def schedule_fingerprint(schedule: Any) -> str:
    """The schedule a run trains with, as canonical JSON for its checkpoints.

    A string, so ``torch.load(weights_only=True)`` reads it; compared by :func:`schedule_changes`.
    """
    return json.dumps(dataclasses.asdict(schedule), sort_keys=True, separators=(",", ":"))


def schedule_changes(old: str | None, new: str, root: str = "data.schedule") -> list[str]:
    """``data.schedule.<key>: OLD -> NEW`` for every value that differs (empty: same, or an old checkpoint
    that did not store it); ``root`` names the canonical JSON's top (:func:`data_settings` too)."""
    if old is None or old == new:
        return []
    out: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif a != b:
            out.append(f"{key}: {a!r} -> {b!r}")

    a, b = json.loads(old), json.loads(new)
    a.pop("lr", None)  # a checkpoint from before the LR moved to model.lr (compared with the module's settings)
    walk(a, b, root)
    return out


DATA_SETTINGS = ("sources", "text_column", "id_column", "min_chunks_per_source", "val_tokens_per_source",
                 "on_bad_shard")
"""``data:`` settings that decide, with the corpus files, the chunks the data order is built on."""


def data_settings(cfg: Any) -> str:
    """The :data:`DATA_SETTINGS` of a data config and its tokenizer's identity as canonical JSON, for its
    checkpoints."""
    values = {**{k: getattr(cfg, k) for k in DATA_SETTINGS}, "tokenizer": cfg.tokenizer.build().identity}
    return json.dumps(values, sort_keys=True, separators=(",", ":"), default=dataclasses.asdict)


def check_data_settings(old: str | None, new: str, allow: bool, step: int) -> None:
    """A resume under other :data:`DATA_SETTINGS` cuts the corpus into other chunks, so the data order
    cannot continue: refused naming each key and its two values (a setting is simply restored), unless
    ``run.allow_changed_data`` (the order then starts afresh, as for a changed corpus). Another tokenizer is
    refused whatever the flags: the model's embedding rows mean its tokens (a checkpoint from before the
    tokenizer was recorded was trained with cl100k_base)."""
    if old is not None:
        was, now = json.loads(old).get("tokenizer", CL100K_IDENTITY), json.loads(new)["tokenizer"]
        if was != now:
            raise ConfigError(f"--ckpt_path: the checkpoint (step {step}) was trained with data.tokenizer {was}, "
                              f"this run has {now}: a resume keeps its tokenizer (the model's embedding rows are its "
                              "tokens); give the checkpoint's data.tokenizer, or start a new run in another --run.dir")
        old = json.dumps({**json.loads(old), "tokenizer": now}, sort_keys=True, separators=(",", ":"))
    changes = schedule_changes(old, new, "data")
    if changes and not allow:
        raise ConfigError(f"--ckpt_path: the checkpoint (step {step}) was trained with other data settings: "
                          f"{'; '.join(changes)}; they decide the chunks its data order is built on: give the "
                          "checkpoint's value again (the first of each pair) to resume it")


def check_schedule_unchanged(old: str | None, new: str, allow: bool, step: int, branch: bool = False) -> None:
    """A resume under another schedule silently moves the anneal and the LR decay (a larger
    ``train_tokens`` puts a run that was annealing back into the stable phase): refused like a changed
    seed, unless ``run.allow_changed_schedule``, or ``run.branch`` for the one change a branch makes
    (:func:`check_branch`)."""
    changes = schedule_changes(old, new)
    if not changes:
        return
    if branch and not allow:
        return check_branch(old, new, step, changes)
    if not allow:
        raise ConfigError(
            f"--ckpt_path: the checkpoint (step {step}) was trained with another schedule: {'; '.join(changes)}; "
            "restore those values, or pass --run.allow_changed_schedule true to continue under the new schedule "
            "from this step (its LR and mixture at this step may jump)"
        )
    log.warning("resuming at step %d under a changed schedule (run.allow_changed_schedule): %s", step,
                "; ".join(changes))


def check_branch(old: str, new: str, step: int, changes: list[str]) -> None:
    """``run.branch`` (a decay branch, ablations/branch.py): another mixture from the checkpoint's ``step`` on,
    nothing else. Every other schedule value and the weights at every step before ``step`` must match
    (else refused, naming them); the change is logged as ``branch at step S: ...``."""
    other = [c for c in changes if not c.startswith("data.schedule.mixture")]
    if other:
        raise ConfigError(f"--run.branch: a branch changes only the mixture, but the checkpoint (step {step}) "
                          f"differs in {'; '.join(other)}; restore those values (docs/config.md, resuming)")
    a, b = (ScheduleConfig.from_dict(json.loads(s)).build() for s in (old, new))
    differ = next((t for t in range(step) if a.mixture_weights(t) != b.mixture_weights(t)), None)
    if differ is not None or a.sources != b.sources:
        raise ConfigError(f"--run.branch: the new mixture differs from the checkpoint's at step "
                          f"{differ if differ is not None else 0}, before the checkpoint's step {step}: a branch "
                          "changes the mixture from its step on only (branch from a checkpoint at or before the "
                          "anneal start)")
    log.warning("branch at step %d: %s", step, "; ".join(changes))
