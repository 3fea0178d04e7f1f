"""Contract test: the torchtitan 0.3.0 internals that gefen_titan relies on.

gefen_titan subclasses and calls into parts of torchtitan that are not its
public API: the optimizer registry hook, the checkpoint manager's load path,
the text dataset's resume state, the data loader's per-rank checkpoint
entries, the config override mechanism. This module pins each of them by
behaviour where that is cheap, and by signature where it is not. When a check
fails, torchtitan changed under us: the fix is NOT to loosen the test but to
revisit the module named in the failing test (and the pin in pyproject.toml).
The CPU patches pin their own targets (``patches/``, ``PatchTargetChanged``).
"""

from __future__ import annotations

import inspect
import pickle
import re
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = "0.3.0"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_torchtitan_is_the_pinned_version():
    assert version("torchtitan") == EXPECTED
    assert f'"torchtitan=={EXPECTED}"' in (ROOT / "pyproject.toml").read_text()


# --------------------------------------- gefen_titan/optim/container.py, registry.py
def test_optimizer_registry_hook():
    """GefenOptimizersContainer overrides ``_resolve_optimizer_factory`` (a
    staticmethod of name -> factory) to add Gefen, and builds per-name groups
    through torchtitan's ``__init__``, which must call it."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    raw = inspect.getattr_static(OptimizersContainer, "_resolve_optimizer_factory")
    assert isinstance(raw, staticmethod) and _params(raw.__func__) == ["name"]
    assert OptimizersContainer._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
    with pytest.raises(NotImplementedError):
        OptimizersContainer._resolve_optimizer_factory("Gefen")
    assert "self._resolve_optimizer_factory(" in inspect.getsource(OptimizersContainer.__init__)
    assert _params(OptimizersContainer.__init__)[:3] == ["self", "config", "model_parts"]
    assert {f.name for f in fields(ParamGroupConfig)} >= {"pattern", "optimizer_name", "optimizer_kwargs"}
    # Our Config adds the name/lr/betas shorthand on top of these.
    names = {f.name for f in fields(OptimizersContainer.Config)}
    assert names == {"param_groups", "implementation", "optimizer_factory_kwargs_by_name"}


def test_optimizer_state_helpers():
    from torchtitan.components.optimizer import utils

    assert _params(utils.get_flat_optim_state_dict) == ["optim"]
    assert _params(utils.load_flat_optim_state_dict) == ["optim", "flat_sd"]
    assert _params(utils.init_optim_state) == ["optim"]
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([("w", p)], lr=0.1)  # named: the flat keys are FQNs
    p.grad = torch.ones(3)
    opt.step()
    flat = utils.get_flat_optim_state_dict(opt)
    assert {"state.w.exp_avg", "state.w.exp_avg_sq", "state.w.step", "param_groups.w.lr"} <= set(flat)
    fresh = torch.optim.AdamW([("w", torch.nn.Parameter(torch.zeros(3)))], lr=0.5)
    utils.init_optim_state(fresh)
    utils.load_flat_optim_state_dict(fresh, flat)
    assert torch.equal(fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg"], opt.state[p]["exp_avg"])
    assert fresh.param_groups[0]["lr"] == 0.1


# -------------------------------------- gefen_titan/checkpoint/manager.py
def test_checkpoint_manager_load_path():
    """GefenCheckpointManager overrides ``dcp_load`` (same signature) and reads
    ``self.states``; torchtitan's ``_load`` must route every load through it."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer import base

    assert _params(CheckpointManager.dcp_load) == ["self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"]
    assert "self.dcp_load(" in inspect.getsource(CheckpointManager._load)
    assert "self.states" in inspect.getsource(CheckpointManager.__init__)
    assert (base.MODEL, base.OPTIMIZER, base.DATALOADER, base.TRAIN_STATE) == (
        "model", "optimizer", "dataloader", "train_state")
    names = {f.name for f in fields(CheckpointManager.Config)}
    assert names >= {"enable", "folder", "interval", "async_mode", "load_step", "exclude_from_loading",
                     "initial_load_path", "last_save_model_only", "keep_latest_k"}


def test_checkpoint_manager_save_path():
    """GefenCheckpointManager overrides ``dcp_save``, ``_wait_for_saving`` (an ENOSPC in an async
    save's writer surfaces there) and ``_purge_stale_checkpoints`` (complete checkpoints only), and
    calls ``_should_purge``, ``purge_queue``; torchtitan's ``_save`` must save through ``dcp_save`` and
    purge after it, and ``maybe_wait_for_saving`` wait through ``_wait_for_saving``."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer import base

    assert _params(CheckpointManager.dcp_save) == ["self", "state_dict", "checkpoint_id", "async_mode",
                                                   "enable_garbage_collection", "to_hf"]
    save = inspect.getsource(CheckpointManager._save)
    assert "self.dcp_save(" in save and "self._purge_stale_checkpoints()" in save
    assert "self._wait_for_saving()" in inspect.getsource(base.BaseCheckpointManager.maybe_wait_for_saving)
    assert _params(CheckpointManager._should_purge) == ["self"]
    assert "self.purge_queue" in inspect.getsource(CheckpointManager.__init__)
    assert "step-" in inspect.getsource(CheckpointManager._create_checkpoint_id)


def test_remote_paths_rule():
    """gefen_titan.checkpoint.io.storage picks fsspec exactly where torchtitan does."""
    from torchtitan.tools import filesystem

    assert filesystem.is_remote("s3://b/ckpt") and filesystem.is_remote("file:///x")
    assert not filesystem.is_remote("/local/ckpt")


# ------------------------------------------- gefen_titan/data/elastic*.py
def test_text_dataset_resume_state(tmp_path):
    """ElasticTextDataset subclasses HuggingFaceTextDataset and reads its
    ``_original_data`` / ``_data`` / ``_sample_idx`` / ``_epoch`` and its
    state_dict keys; ``reloop`` resets to the rank's own split."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset, _validate_dataset

    from gefen_titan.data import corpus as data

    assert isinstance(DATASETS, dict)
    assert {f.name for f in fields(DatasetConfig)} == {"path", "loader", "sample_processor"}
    data.register_datasets()
    path, loader, _ = _validate_dataset(data.DATASET_NAME, None)
    assert callable(loader) and path
    assert _params(HuggingFaceTextDataset.__init__) == [
        "self", "dataset_name", "dataset_path", "tokenizer", "seq_len", "dp_rank", "dp_world_size", "infinite"]
    tok = HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)
    ds = HuggingFaceTextDataset(dataset_name=data.DATASET_NAME, dataset_path=None, tokenizer=tok, seq_len=64,
                                dp_rank=1, dp_world_size=2, infinite=True)
    assert ds._data is ds._original_data and ds._sample_idx == 0
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert set(state) == {"inputs_buffer", "labels_buffer", "positions_buffer", "sample_idx", "epoch"}
    assert state["sample_idx"] == ds._sample_idx > 0 and ds._epoch == state["epoch"] == 0
    ds.reloop()
    assert ds._sample_idx == 0 and ds._epoch == 1


def test_dataloader_checkpoint_entries():
    """torchtitan keeps one pickled state per DP rank under ``dp_rank_{r}`` plus
    ``world_size``; the elastic loader reads every source rank's entry."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    src = inspect.getsource(ParallelAwareDataloader)
    assert 'f"dp_rank_{dp_rank}"' in src and '"world_size": self.dp_world_size' in src
    assert "pickle.dumps(" in src and "pickle.loads(" in src
    assert _params(ParallelAwareDataloader.__init__)[:4] == ["self", "dataset", "dp_rank", "dp_world_size"]
    loader = ParallelAwareDataloader(_Numbers(), dp_rank=1, dp_world_size=2, batch_size=1)
    state = loader.state_dict()
    assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
    assert isinstance(pickle.loads(state["dp_rank_1"]), dict)


class _Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


# ----------------------------- gefen_titan/recipe/, gefen_titan/validation/hooks.py
def test_config_surface():
    """Recipes map ``[job] dump_folder / hf_assets_path`` to top-level
    Trainer.Config fields, rebuild models with ``model_registry``, start from
    ``config_registry`` functions, and hooks use ``@override`` + ``derive``."""
    from torchtitan.config import override
    from torchtitan.config.override import derive
    from torchtitan.models.llama3 import config_registry, model_registry
    from torchtitan.trainer import Trainer

    top = {f.name for f in fields(Trainer.Config)}
    assert top >= {"dump_folder", "hf_assets_path", "model_spec", "optimizer", "lr_scheduler", "training",
                   "parallelism", "checkpoint", "dataloader", "metrics", "validator", "debug", "override",
                   "activation_checkpoint", "compile"}
    assert _params(override)[:1] == ["target"] and {"exact", "description"} <= set(_params(override))
    assert _params(derive) == ["source", "target_cls", "deltas"]
    assert "attn_backend" in _params(model_registry)
    # recipe.converters records the base functions' converters through this global, by this keyword.
    assert "converters" in _params(model_registry) and config_registry.model_registry is model_registry
    config = config_registry.llama3_debugmodel()
    assert isinstance(config, Trainer.Config) and re.fullmatch(r"\S+", config.dump_folder)
