"""Recipes: every shipped one parses into a valid torchtitan config, CLI
overrides win over the file, and bad keys/types/meshes are RecipeErrors that
name the file and the key."""

from pathlib import Path

import pytest
from torchtitan.trainer import Trainer

from gefen_titan.optim import param_groups
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.recipe import RecipeError, declared_world_size, load_recipe
from gefen_titan.recipe.cli import load_cli, parse_cli
from gefen_titan.recipe.files import read_recipe_tables

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
DEBUG = str(ROOT / "recipes" / "llama_gefen.toml")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_parses(path):
    world = declared_world_size(path)
    recipe = load_recipe(path, world_size=world)
    config = recipe.config
    assert isinstance(config, Trainer.Config)
    assert isinstance(config.optimizer, GefenOptimizersContainer.Config)
    assert config.model_spec is not None
    # Every recipe in this project trains Gefen somewhere.
    names = {g.optimizer_name for g in param_groups.resolved_param_groups(config.optimizer)}
    assert "Gefen" in names
    assert Path(config.hf_assets_path).exists() or "8b" in path.name


def test_recipes_declare_1_2_4_shards():
    declared = {
        read_recipe_tables(str(p)).get("parallelism", {}).get("data_parallel_shard_degree", -1) for p in RECIPES
    }
    assert {1, 2, 4} <= declared


def test_debug_recipe_values():
    config = load_recipe(DEBUG, world_size=2).config
    assert config.optimizer.name == "Gefen"
    assert config.optimizer.lr == pytest.approx(2e-3)
    assert config.optimizer.betas == (0.9, 0.95)
    assert config.model_spec.flavor == "debugmodel"
    assert config.dataloader.dataset == "gefen_tiny"
    assert config.activation_checkpoint is None
    assert config.checkpoint.enable is True
    # [optimizer] name replaced the base function's AdamW catch-all group.
    (group,) = param_groups.resolved_param_groups(config.optimizer)
    assert group.optimizer_name == "Gefen" and group.pattern == ".*"
    assert group.optimizer_kwargs["lr"] == pytest.approx(2e-3)


def test_cli_overrides_win_over_recipe():
    config = load_cli(
        [
            "--job.config", DEBUG,
            "--training.steps", "7",
            "--parallelism.data-parallel-shard-degree=4",
            "--checkpoint.exclude_from_loading", "dataloader,optimizer",
            "--optimizer.betas", "0.8", "0.9",
            "--optimizer.lr=1e-3",
            "--checkpoint.async_mode", "async",
            "--activation_checkpoint.mode", "full",
            "--metrics.enable_tensorboard",
        ],
        world_size=4,
    ).config
    assert config.training.steps == 7
    assert config.parallelism.data_parallel_shard_degree == 4
    assert config.checkpoint.exclude_from_loading == ["dataloader", "optimizer"]
    assert config.optimizer.betas == (0.8, 0.9)
    assert config.optimizer.lr == pytest.approx(1e-3)
    assert config.checkpoint.async_mode == "async"
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert config.metrics.enable_tensorboard is True


def _write(tmp_path, text, name="bad.toml"):
    p = tmp_path / name
    base = Path(DEBUG).read_text()
    p.write_text(base + "\n" + text)
    return str(p)


@pytest.mark.parametrize(
    "extra, overrides, message",
    [
        ("[trainingg]\nsteps = 3\n", None, "[trainingg] unknown section"),
        ("", {"training": {"stepz": 3}}, "[training] stepz: unknown key for TrainingConfig"),
        ("", {"training": {"steps": "ten"}}, "[training] steps: expected an integer, got 'ten'"),
        ("", {"optimizer": {"lr": "fast"}}, "[optimizer] lr: expected a number"),
        ("", {"optimizer": {"betas": [0.9]}}, "[optimizer] betas: expected an array of 2 items"),
        ("", {"optimizer": {"name": "SGD"}}, "[optimizer] name: must be one of"),
        ("", {"checkpoint": {"enable": 1}}, "[checkpoint] enable: expected a boolean"),
        ("", {"model": {"flavor": "13B"}}, "[model] flavor: unknown flavor '13B'"),
        ("", {"model": {"layers": 3}}, "[model] layers: unknown key"),
        ("", {"job": {"base_config": "nope"}}, "[job] base_config: 'nope' is not a config function"),
        ("", {"job": {"colour": "red"}}, "[job] colour: unknown key"),
        ("", {"activation_checkpoint": {"mode": "some"}}, "[activation_checkpoint] mode: must be one of"),
        ("", {"parallelism": {"data_parallel_shard_degree": 3}}, "impossible mesh: data_parallel_shard_degree(3)"),
        ("", {"parallelism": {"tensor_parallel_degree": 3}}, "does not divide the world size 2"),
    ],
)
def test_bad_recipes_name_file_and_key(tmp_path, extra, overrides, message):
    path = _write(tmp_path, extra)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides, world_size=2)
    assert str(info.value).startswith(path)
    assert message in str(info.value)


def test_flat_optimizer_keys_of_older_recipes_set_their_kinds_tables(tmp_path):
    """[optimizer] muon_bucket_mib, deterministic, backup_optimizer, ... (before the kinds' tables) are
    read into [optimizer.muon] / .gefen / .hybrid; a key set both ways is refused, naming both."""
    flat = {"muon_bucket_mib": 3, "deterministic": True, "cpu_step": "gefen-x", "period_one_substrings": ["out"],
            "backup_optimizer": "adamw", "normuon": False, "name": "GefenMuonHybrid"}
    opt = load_recipe(DEBUG, {"optimizer": flat}, world_size=2).config.optimizer
    assert (opt.muon.bucket_mib, opt.muon.deterministic, opt.muon.cpu_step) == (3.0, True, "gefen-x")
    assert (opt.gefen.deterministic, opt.gefen.cpu_step, opt.gefen.period_one_substrings) == (True, "gefen-x", ["out"])
    assert (opt.hybrid.backup_optimizer, opt.hybrid.normuon) == ("adamw", False)
    table = load_recipe(_write(tmp_path, "[optimizer.muon]\nbucket_mib = 4\n"), world_size=2).config.optimizer
    assert table.muon.bucket_mib == 4.0 and table.gefen.deterministic is False
    both = _write(tmp_path, "[optimizer.muon]\ndeterministic = false\n")
    with pytest.raises(RecipeError, match=r"\[optimizer\] deterministic and \[optimizer.muon\] deterministic are both "
                       r"set: deterministic is the older spelling of muon.deterministic"):
        load_recipe(both, {"optimizer": {"deterministic": True}}, world_size=2)
    with pytest.raises(RecipeError, match=r"\[optimizer\] gefen: optimizer.gefen.codebook_refresh_every must be >= 0"):
        load_recipe(DEBUG, {"optimizer": {"codebook_refresh_every": -1}}, world_size=2)


def test_not_toml_and_missing_file(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text("[job\n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.toml")
    # what does exist there is listed, so a typo is one look away
    with pytest.raises(RecipeError, match=r"not found; the recipes in .*: x\.toml$"):
        load_recipe(tmp_path / "missing.toml")


def test_cli_requires_recipe_and_well_formed_flags():
    with pytest.raises(RecipeError, match="--job.config PATH"):
        parse_cli(["--training.steps", "3"])
    with pytest.raises(RecipeError, match="Unrecognized options: steps"):
        load_cli(["--job.config", DEBUG, "steps"], world_size=2)
    with pytest.raises(RecipeError, match="Unrecognized options: --steps"):
        load_cli(["--job.config", DEBUG, "--steps", "3"], world_size=2)


def test_mesh_uses_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = load_recipe(DEBUG).config  # dp_shard = -1 fills 4
    assert config.parallelism.data_parallel_shard_degree == -1
    with pytest.raises(RecipeError, match="world size is 4"):
        load_recipe(DEBUG, {"parallelism": {"data_parallel_shard_degree": 2}})


def test_bad_recipe_fails_before_any_process_group(tmp_path):
    """The train entry reads the recipe before config.build() (which inits
    the process group), so a bad recipe leaves torch.distributed untouched."""
    import torch.distributed as dist

    from gefen_titan.train import build_config

    path = _write(tmp_path, "", "ok.toml")
    with pytest.raises(RecipeError):
        build_config(["--job.config", path, "--training.steps", "x"])
    assert not dist.is_initialized()


def test_a_registered_loader_is_a_recipe_choice(monkeypatch):
    """A new loader is its component plus ``register_loader``: ``[dataloader]
    loader`` then picks it and the section's keys are its fields; names are
    not silently taken over."""
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader

    from gefen_titan.data import registry
    from gefen_titan.data.elastic import ElasticTextDataLoader

    monkeypatch.setattr(registry, "_LOADERS", dict(registry._LOADERS))  # this test's registrations only

    @dataclass(kw_only=True, slots=True)
    class ShardedConfig(BaseDataLoader.Config):
        shards: int = 1

    registry.register_loader("sharded", ShardedConfig)
    registry.register_loader("sharded", ShardedConfig)  # the same class again: no-op
    assert registry.loader_names() == ["elastic", "global_order", "sharded"]
    config = load_recipe(DEBUG, {"dataloader": {"loader": "sharded", "shards": 3}}, world_size=2).config
    assert type(config.dataloader) is ShardedConfig and config.dataloader.shards == 3
    with pytest.raises(RecipeError, match=r"\[dataloader\] shards: expected an integer"):
        load_recipe(DEBUG, {"dataloader": {"loader": "sharded", "shards": "3"}}, world_size=2)
    with pytest.raises(
        RecipeError, match=r"\[dataloader\] loader: must be one of \['elastic', 'global_order', 'sharded'\], got 'x'"
    ):
        load_recipe(DEBUG, {"dataloader": {"loader": "x"}}, world_size=2)
    with pytest.raises(ValueError, match="'sharded' is already registered as"):
        registry.register_loader("sharded", ElasticTextDataLoader.Config)
    with pytest.raises(TypeError, match="not a BaseDataLoader.Config dataclass"):
        registry.register_loader("plain", dict)


def test_a_dp_invariant_loader_gets_the_global_batch_check(monkeypatch):
    """The recipe checks ask the registry whether a loader is DP-invariant, not
    for a class: a new loader registered so needs a fixed global batch too."""
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader

    from gefen_titan.data import registry

    monkeypatch.setattr(registry, "_LOADERS", dict(registry._LOADERS))  # this test's registrations only
    monkeypatch.setattr(registry, "_DP_INVARIANT", set(registry._DP_INVARIANT))

    @dataclass(kw_only=True, slots=True)
    class OrderedConfig(BaseDataLoader.Config):
        pass

    registry.register_loader("ordered", OrderedConfig, dp_invariant=True)
    assert registry.is_dp_invariant(OrderedConfig()) and registry.dp_invariant_names() == '"global_order" or "ordered"'
    with pytest.raises(RecipeError, match=r'global_batch_size: \[dataloader\] loader = "global_order" or "ordered" '
                                          "needs a fixed global batch"):
        load_recipe(DEBUG, {"dataloader": {"loader": "ordered"}}, world_size=2)
    load_recipe(DEBUG, {"dataloader": {"loader": "ordered"}, "training": {"global_batch_size": 8}}, world_size=2)


def test_components_lift_torchtitans_stock_configs_themselves():
    from dataclasses import dataclass

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from gefen_titan.checkpoint.manager import GefenCheckpointManager
    from gefen_titan.data.elastic import ElasticTextDataLoader

    stock = CheckpointManager.Config(enable=True, folder="ck", interval=7)
    ours = GefenCheckpointManager.Config.from_torchtitan(stock)
    assert type(ours) is GefenCheckpointManager.Config
    assert (ours.enable, ours.folder, ours.interval, ours.digest_key_env) == (True, "ck", 7, "")
    assert GefenCheckpointManager.Config.from_torchtitan(ours) is ours

    @dataclass(kw_only=True, slots=True)
    class OtherConfig(CheckpointManager.Config):  # someone's own manager: not ours to replace
        pass

    other = OtherConfig()
    assert GefenCheckpointManager.Config.from_torchtitan(other) is other

    loader = HuggingFaceTextDataLoader.Config(dataset="gefen_tiny", num_workers=0)
    lifted = ElasticTextDataLoader.Config.from_torchtitan(loader)
    assert type(lifted) is ElasticTextDataLoader.Config and lifted.dataset == "gefen_tiny"
    assert lifted.on_dp_change == "continue"
    assert ElasticTextDataLoader.Config.from_torchtitan(lifted) is lifted


OLD_BLOCKING = """
[job]
module = "llama3"
base_config = "llama3_debugmodel"

[optimizer]
name = "Gefen"
blocking = "per_rank"
max_tensor_parallel_degree = 2

[optimizer.gefen]
force_1d_period_one = false
"""


def test_an_older_recipes_blocking_keys_read_as_the_blocking_table(tmp_path):
    """``[optimizer] blocking = "per_rank"`` (a string where the table now is) and the flat
    ``max_tensor_parallel_degree`` give the same config as ``[optimizer.blocking]``."""
    def write(text, name):
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    old = load_recipe(write(OLD_BLOCKING, "old.toml")).config.optimizer
    new_text = OLD_BLOCKING.replace('blocking = "per_rank"\nmax_tensor_parallel_degree = 2\n', "").replace(
        "[optimizer.gefen]", '[optimizer.blocking]\nmode = "per_rank"\nmax_tensor_parallel_degree = 2\n\n'
                             "[optimizer.gefen]")
    assert "blocking = " not in new_text and "[optimizer.blocking]" in new_text
    new = load_recipe(write(new_text, "new.toml")).config.optimizer
    assert old == new and (new.blocking.mode, new.blocking.max_tensor_parallel_degree) == ("per_rank", 2)
    with pytest.raises(RecipeError, match=r"\[optimizer\] blocking.mode: must be one of \['agreed', 'per_rank'\]"):
        load_recipe(write(OLD_BLOCKING.replace('"per_rank"', '"sometimes"'), "bad.toml"))


def test_an_older_spelling_in_a_recipe_that_extends_a_table_recipe_wins_as_its_keys_do(tmp_path):
    """Lifted per file before ``extends`` merges: a child's flat ``max_tensor_parallel_degree`` and string
    ``blocking`` set the places of the parent's ``[optimizer.blocking]`` table (llama_gefen.toml: degree 2)
    and win, as any key of the child does."""
    child = tmp_path / "child.toml"
    child.write_text(f'[job]\nextends = "{ROOT / "recipes" / "llama_gefen.toml"}"\n\n'
                     '[optimizer]\nblocking = "agreed"\nmax_tensor_parallel_degree = 4\n')
    blocking = load_recipe(str(child)).config.optimizer.blocking
    assert (blocking.mode, blocking.max_tensor_parallel_degree) == ("agreed", 4)
    # Both spellings in one file still say which one was meant: neither.
    child.write_text(child.read_text().replace('blocking = "agreed"\n', "")
                     + '\n[optimizer.blocking]\nmax_tensor_parallel_degree = 2\n')
    with pytest.raises(RecipeError, match="max_tensor_parallel_degree and .optimizer.blocking. max_tensor_parallel"):
        load_recipe(str(child))
