"""FSDP2 (``--trainer.strategy fsdp``: fully_shard per block, train/parallel.py) on 2 CPU ranks (gloo).

The checkpoint is a torch.distributed.checkpoint folder (one shard per rank) whose ``meta.pt`` names
the folder of both ranks' data cursor files (each rank wrote its own, beside the sharded folder); a
run stopped at step 4 and resumed from it matches the uninterrupted run line for line, and both draw
the same documents as the DDP reference (same ranks x micro-batch).
"""

from __future__ import annotations

import pytest
import torch
from training_runs import DDP, TINY, assert_same_order, order_log, run_to_end

from train.cursor_files import load_checkpoint_cursors

FSDP = [a if a != "ddp" else "fsdp" for a in DDP]  # 2 CPU ranks, micro-batch 2


@pytest.mark.slow
def test_fsdp_two_cpu_ranks_sharded_checkpoint_and_exact_resume(workdir, env, ref_ddp):
    ref_dir = workdir / "fsdp_ref"
    run_to_end(workdir, ref_dir, TINY + FSDP, env, "fsdp_ref")
    ref = order_log(ref_dir)

    _, ddp = ref_ddp  # same data order as DDP (losses differ in the last bits: another reduction order)
    assert {r: [ln["pieces"] for ln in lines] for r, lines in ref.items()} == \
        {r: [ln["pieces"] for ln in lines] for r, lines in ddp.items()}

    run_dir = workdir / "fsdp_resumed"
    run_to_end(workdir, run_dir, TINY + FSDP + ["--trainer.max_steps", "4"], env, "first")
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and {p.name for p in last.iterdir()} >= {"__0_0.distcp", "__1_0.distcp", "meta.pt"}
    meta = torch.load(last / "meta.pt", map_location="cpu", weights_only=True)
    assert meta["global_step"] == 4 and meta["WellMixedData"]["world_size"] == 2
    state = meta["WellMixedData"]  # each rank wrote its own cursor file, beside the sharded folder
    assert sorted(p.name for p in (last.parent / state["cursor_dir"]).iterdir()) == ["rank00000.pt", "rank00001.pt"]
    assert all(c is not None for rank in load_checkpoint_cursors(last, state) for c in rank)
    run_to_end(workdir, run_dir, TINY + FSDP + ["--ckpt_path", "last"], env, "continued")
    assert_same_order(ref, order_log(run_dir))


def test_strategy_names_resolve():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from train.model import Block
    from train.parallel import resolve_strategy

    assert isinstance(resolve_strategy("fsdp"), ModelParallelStrategy)
    fsdp1 = resolve_strategy("fsdp1")
    assert isinstance(fsdp1, FSDPStrategy) and fsdp1._state_dict_type == "sharded"
    assert fsdp1.kwargs["auto_wrap_policy"]._module_classes == {Block}  # one FSDP unit per block
    assert resolve_strategy("auto") == "auto" and resolve_strategy("ddp") == "ddp"


def test_ddp_keeps_one_bucket_layout_also_where_lightning_picks_it():
    """``auto`` on several devices is Lightning's DDPStrategy: it too wraps the model with
    find_unused_parameters (one gradient bucket layout from the first step: a resume is bitwise,
    tests/integration/test_resume.py); FSDP is left as it is."""
    import lightning as L

    from train.lightning_internals import ddp_kwargs
    from train.parallel import fix_bucket_layout, resolve_strategy

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="auto", logger=False)
    fix_bucket_layout(trainer.strategy)
    assert ddp_kwargs(trainer.strategy) == {"find_unused_parameters": True}
    fsdp = resolve_strategy("fsdp")
    fix_bucket_layout(fsdp)
    assert not hasattr(fsdp, "_ddp_kwargs")


def test_a_checkpoint_of_the_other_layout_is_refused_naming_the_way_out(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    from data.errors import ConfigError
    from train.parallel import check_checkpoint_layout, resolve_strategy

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (tmp_path / "step.ckpt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="sharded FSDP checkpoint .* --trainer.strategy fsdp"):
        check_checkpoint_layout(str(folder), DDPStrategy())
    with pytest.raises(ConfigError, match="single-file .* strategy that wrote it"):
        check_checkpoint_layout(str(tmp_path / "step.ckpt"), resolve_strategy("fsdp"))
    check_checkpoint_layout(str(folder), resolve_strategy("fsdp"))  # the matching layouts pass
    check_checkpoint_layout(str(tmp_path / "step.ckpt"), DDPStrategy())
    check_checkpoint_layout(None, DDPStrategy())
