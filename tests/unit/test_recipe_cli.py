"""train.py's command line speaks torchtitan's CLI over the recipe (top-level
flags, tyro's spellings, --help with the recipe's keys, types and values), its
errors are RecipeErrors before any process group, and no [optimizer] key or
group key is accepted that the optimizer would not use."""

import re
from pathlib import Path

import pytest

from gefen_titan.optim import param_groups
from gefen_titan.recipe import RecipeError, declared_world_size, load_recipe
from gefen_titan.recipe.cli import USAGE, load_cli, parse_cli, parse_flags

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
DEBUG = str(ROOT / "recipes" / "llama_gefen.toml")
MIXED = str(ROOT / "recipes" / "llama_gefen_mixed.toml")
TP2 = str(ROOT / "recipes" / "llama_gefen_tp2.toml")


def _cli(*flags, recipe=DEBUG, world_size=2):
    return load_cli(["--job.config", recipe, *flags], world_size=world_size).config


def _tokenizer():
    from gefen_titan.data import corpus as data

    return data.DEFAULT_TOKENIZER_PATH


@pytest.mark.parametrize(
    "flags, read, expected",
    [
        # torchtitan's top-level flags, both spellings, and the recipe's [job] alias
        (["--dump_folder", "/tmp/a"], lambda c: c.dump_folder, "/tmp/a"),
        (["--dump-folder=/tmp/b"], lambda c: c.dump_folder, "/tmp/b"),
        (["--job.dump_folder", "/tmp/c"], lambda c: c.dump_folder, "/tmp/c"),
        (["--hf_assets_path", "/tmp/tok"], lambda c: c.hf_assets_path, "/tmp/tok"),
        (["--hf-assets-path", "builtin://tokenizer"], lambda c: c.hf_assets_path, _tokenizer()),
        # bools: tyro's flag pairs, and an explicit true/false
        (["--checkpoint.no-enable"], lambda c: c.checkpoint.enable, False),
        (["--checkpoint.enable", "false"], lambda c: c.checkpoint.enable, False),
        (["--checkpoint.last_save_model_only=true"], lambda c: c.checkpoint.last_save_model_only, True),
        (["--metrics.enable_tensorboard"], lambda c: c.metrics.enable_tensorboard, True),
        # lists of strings a,b,c as in torchtitan; tuples as separate values
        (["--checkpoint.exclude_from_loading", "dataloader,optimizer"],
         lambda c: c.checkpoint.exclude_from_loading, ["dataloader", "optimizer"]),
        (["--optimizer.betas", "0.8", "0.9"], lambda c: c.optimizer.betas, (0.8, 0.9)),
        # a union of policies: tyro's subcommand, or the recipe's mode key
        (["activation-checkpoint:full"], lambda c: type(c.activation_checkpoint).__qualname__, "FullAC.Config"),
        (["--activation_checkpoint.mode", "selective"],
         lambda c: type(c.activation_checkpoint).__qualname__, "SelectiveAC.Config"),
        # a recipe flag that changes the loader class, then a field of that class
        (["--dataloader.loader", "global_order", "--training.global_batch_size", "8", "--dataloader.seed", "3"],
         lambda c: (type(c.dataloader).__qualname__, c.dataloader.seed), ("GlobalOrderDataLoader.Config", 3)),
        # later flags win, as in argparse
        (["--training.steps", "5", "--training.steps=6"], lambda c: c.training.steps, 6),
    ],
)
def test_torchtitan_flags_over_the_recipe(flags, read, expected):
    assert read(_cli(*flags)) == expected


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_no_flags_parse_to_the_recipe_itself(path):
    """tyro rebuilds the whole config; with no flags it must be the recipe's."""
    config = load_recipe(path, world_size=declared_world_size(path)).config
    assert parse_flags(config, []) == config


def _plain(text):
    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)


def test_help_lists_the_recipes_sections_keys_types_and_values(capsys):
    with pytest.raises(SystemExit) as info:
        _cli("--training.steps", "33", "--help")
    assert info.value.code == 0
    out = _plain(capsys.readouterr().out)
    for expected in [
        "--dump-folder STR Folder to dump job outputs (default: ./outputs/llama_gefen)",
        "--hf-assets-path STR",
        "How many train steps to run (default: 20)",  # the recipe's value, not the flag's
        "--optimizer.lr {None}|FLOAT",  # None: unset (catch-all 8e-4; groups keep their optimizer's)
        "(default: 0.002)",
        "--optimizer.blocking.mode {agreed,per_rank}",  # the container's own table
        "--optimizer.blocking.max-tensor-parallel-degree INT",
        "--optimizer.gefen.cpu-step {kernel,gefen-x}",  # each kind's own table, a field generated from the registry
        "``[optimizer.gefen]``:",  # a generated table's help: its options class's docstring
        "``[optimizer.muon]``:",
        "--optimizer.muon.bucket-mib FLOAT",
        "--optimizer.hybrid.backup-optimizer {gefen,adamw}",
        "--parallelism.data-parallel-shard-degree INT",
        "--checkpoint.enable, --checkpoint.no-enable",
        "parallelism options",
        "activation-checkpoint:full",
        "--job.config PATH",  # and the recipe's own flags
        "--model.flavor NAME",
        "--dataloader.loader {elastic,global_order}",
    ]:
        assert expected in out, expected


def test_help_without_a_recipe_and_before_the_mesh_check(capsys):
    with pytest.raises(SystemExit) as info:
        load_cli(["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out == USAGE
    # A TP 2 recipe cannot run on 1 process, but its help can be read there.
    with pytest.raises(SystemExit) as info:
        _cli("-h", recipe=TP2, world_size=1)
    assert info.value.code == 0
    assert "--parallelism.tensor-parallel-degree INT" in _plain(capsys.readouterr().out)


def test_train_main_prints_help(capsys):
    """The entry point prints the help and ends without an error: torchelastic's ``@record`` (on ``main``, for
    torchrun's error file) turns the help's ``SystemExit(0)`` into a plain return, so the process exits 0."""
    from gefen_titan.train import main

    assert main(["--job.config", DEBUG, "--help"]) is None
    assert "--training.steps" in _plain(capsys.readouterr().out)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--training.steps", "x"], "Error parsing --training.steps: invalid literal for int()"),
        (["--training.stepz", "3"], "Unrecognized options: --training.stepz"),
        (["--checkpoint.enable", "maybe"], "Unrecognized options: maybe"),
        (["--optimizer.codebook_refresh_every", "1"], "codebook_refresh_every > 0 relearns the codebook"),
        (["--optimizer.gefen.codebook-refresh-every", "1"], "codebook_refresh_every > 0 relearns the codebook"),
        (["--optimizer.muon.bucket_mib", "0"], "optimizer.muon.bucket_mib must be > 0"),
        (["--job.extends", "x.toml"], "--job.extends: not a recipe flag"),
        (["--model.flavor"], "--model.flavor needs a value"),
        (["--model.flavor", "13B"], "[model] flavor: unknown flavor '13B'"),
        (["--dataloader.loader", "megatron"], "[dataloader] loader: must be one of"),
        (["--hf_assets_path", "builtin://nope"], "command line: --hf-assets-path: unknown built-in asset"),
        (["--parallelism.data_parallel_shard_degree", "3"], "impossible mesh: data_parallel_shard_degree(3)"),
    ],
)
def test_bad_flags_are_recipe_errors_before_any_process_group(flags, message):
    import torch.distributed as dist

    with pytest.raises(RecipeError) as info:
        _cli(*flags)
    assert message in str(info.value)
    assert not dist.is_initialized()


def test_recipe_flags_are_taken_off_and_the_rest_kept_in_order():
    cl = parse_cli(["--job.config=r.toml", "--training.steps", "3", "--model.attn-backend", "sdpa",
                    "--job.dump_folder=/d", "--metrics.enable_tensorboard"])
    assert cl.path == "r.toml"
    assert cl.overrides == {"model": {"attn_backend": "sdpa"}, "job": {"dump_folder": "/d"}}
    assert cl.args == ["--training.steps", "3", "--metrics.enable_tensorboard"]


# --- [optimizer]: the shorthand is every group's default, and nothing is ignored


def _groups(config):
    return [(g.pattern, g.optimizer_name, dict(g.optimizer_kwargs))
            for g in param_groups.resolved_param_groups(config.optimizer)]


def test_mixed_recipe_groups_take_the_shorthand_as_defaults():
    # What the recipe spelled out in full before its groups took defaults.
    assert _groups(load_recipe(MIXED, world_size=2).config) == [
        ("norm", "AdamW", {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}),
        (".*", "Gefen", {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
    ]
    # The README's --optimizer.lr now reaches the group that takes the default.
    (adamw, gefen) = _groups(_cli("--optimizer.lr", "1e-3", "--optimizer.name", "Adam", recipe=MIXED))
    assert adamw[2]["lr"] == 8e-4 and adamw[1] == "AdamW"
    assert gefen[2]["lr"] == 1e-3 and gefen[1] == "Adam"
    # tyro also reaches into a group.
    (adamw, _) = _groups(_cli("--optimizer.param-groups.0.optimizer-kwargs.lr", "5e-4", recipe=MIXED))
    assert adamw[2]["lr"] == 5e-4


SELF_CONTAINED = """\
[job]
module = "llama3"
base_config = "llama3_debugmodel"
hf_assets_path = "builtin://tokenizer"

[[optimizer.param_groups]]
pattern = ".*"
optimizer_name = "Gefen"
optimizer_kwargs = { lr = 1e-3, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
"""


@pytest.mark.parametrize("key, value", [("lr", "2e-3"), ("name", "Adam"), ("weight_decay", "0.0")])
def test_shorthand_that_no_group_takes_is_refused(tmp_path, key, value):
    # In the file (here inherited, as the mixed recipe once did) ...
    child = tmp_path / "child.toml"
    child.write_text(f'[job]\nextends = "{DEBUG}"\n\n' + SELF_CONTAINED.split("\n\n", 1)[1])
    with pytest.raises(RecipeError) as info:
        load_recipe(child, world_size=2)
    assert str(info.value).startswith(f"{child}: [optimizer] ")
    assert "has no effect: every [[optimizer.param_groups]] sets its own" in str(info.value)
    # ... and on the command line, over a recipe whose groups set everything.
    alone = tmp_path / "alone.toml"
    alone.write_text(SELF_CONTAINED)
    load_recipe(alone, world_size=2)  # defaults nobody set are no error
    with pytest.raises(RecipeError) as info:
        _cli(f"--optimizer.{key}", value, recipe=str(alone))
    assert str(info.value).startswith(f"command line: --optimizer.{key.replace('_', '-')}: has no effect")


@pytest.mark.parametrize(
    "group, message",
    [
        ({"pattern": ".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"learning_rate": 1e-3}},
         "param_groups[0] optimizer_kwargs: AdamW does not read 'learning_rate'"),
        ({"pattern": ".*", "optimizer_kwargs": {"stochastic_round": True}},
         "param_groups[0] optimizer_kwargs: gefen-x's Gefen option 'stochastic_round' is refused: on CUDA"),
        ({"pattern": ".*", "optimizer_kwargs": {"deterministic": True}}, "set optimizer.gefen.deterministic"),
        ({"pattern": ".*", "optimizer_name": "SGD"}, "param_groups[0]: unknown optimizer 'SGD'"),
        ({"pattern": ".*", "optimizer_kwargs": {"lr": 1e-3}, "optimizer_nam": "Gefen"},
         "param_groups[0].optimizer_nam: unknown key"),
    ],
)
def test_group_keys_the_optimizer_would_ignore_are_refused(group, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(DEBUG, {"optimizer": {"param_groups": [group]}}, world_size=2)
    assert str(info.value).startswith(DEBUG)
    assert message in str(info.value)


def test_factory_kwargs_of_an_unused_optimizer_are_refused():
    with pytest.raises(RecipeError, match="optimizer_factory_kwargs_by_name: no param group uses 'AdamW'"):
        load_recipe(DEBUG, {"optimizer": {"optimizer_factory_kwargs_by_name": {"AdamW": {}}}}, world_size=2)


def test_global_order_dataset_name_beside_a_path_is_refused():
    path = str(ROOT / "recipes" / "llama_gefen_global_order.toml")
    load_recipe(path, {"dataloader": {"dataset_path": "data/x"}}, world_size=2)  # the default name: fine
    with pytest.raises(RecipeError, match=r"\[dataloader\]: dataloader.dataset = 'c4' is not read when"):
        load_recipe(path, {"dataloader": {"dataset": "c4", "dataset_path": "data/x"}}, world_size=2)


def test_flat_optimizer_flags_of_older_commands_set_their_kinds_tables():
    """``--optimizer.backup_optimizer adamw`` (README), ``--optimizer.deterministic true``, ... still work, as
    the kinds' flags; one given both ways is refused."""
    hybrid = str(ROOT / "recipes" / "llama_gefen_muon_hybrid.toml")
    opt = _cli("--optimizer.backup_optimizer", "adamw", "--optimizer.deterministic", "true", "--optimizer.no-normuon",
               "--optimizer.muon-bucket-mib=3", "--optimizer.cpu_step", "gefen-x", recipe=hybrid).optimizer
    assert (opt.hybrid.backup_optimizer, opt.hybrid.normuon, opt.muon.bucket_mib) == ("adamw", False, 3.0)
    assert opt.gefen.deterministic and opt.muon.deterministic and opt.gefen.cpu_step == opt.muon.cpu_step == "gefen-x"
    per_rank = _cli("--optimizer.no_force_1d_period_one", "--optimizer.blocking", "per_rank").optimizer
    assert per_rank.gefen.force_1d_period_one is False
    with pytest.raises(RecipeError, match="--optimizer.deterministic and --optimizer.gefen.deterministic both given"):
        _cli("--optimizer.deterministic", "--optimizer.gefen.no-deterministic")


def test_older_blocking_flags_set_the_blocking_table():
    """``--optimizer.blocking per_rank`` and ``--optimizer.max_tensor_parallel_degree 4`` (older commands) are
    ``--optimizer.blocking.mode`` and ``--optimizer.blocking.max_tensor_parallel_degree``; both ways is refused."""
    old = _cli("--optimizer.no_force_1d_period_one", "--optimizer.blocking", "per_rank",
               "--optimizer.max_tensor_parallel_degree", "4").optimizer
    new = _cli("--optimizer.no_force_1d_period_one", "--optimizer.blocking.mode", "per_rank",
               "--optimizer.blocking.max-tensor-parallel-degree", "4").optimizer
    assert old == new and (new.blocking.mode, new.blocking.max_tensor_parallel_degree) == ("per_rank", 4)
    assert _cli("--optimizer.blocking=per_rank", "--optimizer.no_force_1d_period_one").optimizer.blocking.mode == \
        "per_rank"
    with pytest.raises(RecipeError, match="--optimizer.blocking and --optimizer.blocking.mode both given"):
        _cli("--optimizer.blocking", "per_rank", "--optimizer.blocking.mode", "agreed")
    with pytest.raises(RecipeError, match="per_rank"):  # a bad value: one message naming the choices
        _cli("--optimizer.blocking", "sometimes")
