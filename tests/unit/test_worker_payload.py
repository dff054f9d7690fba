"""What a DataLoader worker receives: the DataConfig and the rank facts, never the DataModule or the Trainer.

The DataModule holds a :class:`~data.config.DataConfig`; the dataset it hands the DataLoader (pickled into
every worker under the ``spawn`` start method, copied under ``fork``) holds that config, the manifest, the
schedules and the rank facts. Guards: the DataModule passed as ``cfg`` into the data path, which carried
the Trainer (and everything behind it) into every worker.
"""

from __future__ import annotations

import io
import pickle

import lightning as L

from data.config import DataConfig
from train.datamodule import WellMixedData


class _Recorder(pickle.Pickler):
    """A pickler that notes the type of every object it writes."""

    def __init__(self, file):
        super().__init__(file)
        self.types: set[type] = set()

    def reducer_override(self, obj):
        self.types.add(type(obj))
        return NotImplemented


def test_a_worker_receives_the_data_config_and_the_rank_facts_only(make_cfg):
    cfg = make_cfg(num_workers=2)
    dm = WellMixedData(cfg)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False)
    dm.prepare()
    loader = dm.train_dataloader()
    recorder = _Recorder(io.BytesIO())
    recorder.dump(loader.dataset)  # what DataLoader's workers are given
    heavy = [t for t in recorder.types if issubclass(t, (L.LightningDataModule, L.Trainer))]
    assert not heavy, heavy
    assert type(loader.dataset.cfg) is DataConfig and loader.dataset.cfg == cfg
    assert (loader.dataset.rank, loader.dataset.world_size, loader.dataset.workers) == (0, 1, 2)
    assert dm.context().config is cfg  # the prepared data names the config, not the DataModule


def test_the_datamodule_rebuilds_its_config_from_a_checkpoint_s_hyperparameters(make_cfg):
    """``WellMixedData.load_from_checkpoint`` (evaluate) instantiates the class from its saved hparams."""
    from lightning.pytorch.cli import instantiate_module

    cfg = make_cfg()
    hparams = dict(WellMixedData(cfg).hparams)
    assert hparams.pop("_instantiator") == "lightning.pytorch.cli.instantiate_module"
    again = instantiate_module(WellMixedData, hparams)
    assert type(again.config) is DataConfig and again.config == cfg
