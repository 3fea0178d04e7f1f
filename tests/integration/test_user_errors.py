"""A user's error under torchrun (issue 49): the message once from rank 0, no traceback of
ours, a non-zero exit, and torchrun's "Root Cause" showing it; and a resume with
nothing left to train says so and exits 0.

Every case fails before training: the recipe ones before any process group, the
checkpoint ones at the load of the stored format-v2 fixture (no training run
needed), the data one when the loader opens its file.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import processes

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "v2_debug_fsdp2_step3"
# What follows our block on 2 ranks (Python 3.11) is torchrun's, whatever the ranks print,
# and we cannot shorten it: its failure lines (1-3), its own traceback of ChildFailedError
# (17 lines) and its summary (14 lines with one failure listed, plus the message's lines
# under "Root Cause"). Ours is the block (2 lines). What comes before the error
# (torchrun's OMP_NUM_THREADS notice, torchtitan's start-up logs) is not the error's.
TORCHRUN_OWN = 3 + 17 + 14


def launch(*args):
    env = {k: v for k, v in os.environ.items() if k != "GEFEN_TITAN_TRACEBACK"}
    proc = processes.torchrun(2, str(ROOT / "train.py"), *args, timeout=400, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def check_reported(rc, out, *needles):
    assert rc != 0, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("gefen-titan: error: ")]
    assert len(ours) == 1, out[-4000:]  # rank 0 only, once
    for needle in needles:
        assert needle in ours[0], ours[0]
    # no rank's traceback: the one traceback is torchrun's own ChildFailedError
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
    root = out[out.index("Root Cause (first observed failure)"):]
    assert ours[0][:120] in root, root  # torchrun's error file shows the message
    # ... and only there: rank 1 left when torchrun stopped it, so it is no second failure
    assert out.count(ours[0][len("gefen-titan: error: "):][:120]) == 2, out[-4000:]
    assert "<NO_OTHER_FAILURES>" in out, out[-4000:]
    lines = out.splitlines()
    tail = lines[lines.index(ours[0]):]
    block = 1 + next(i for i, line in enumerate(tail) if "GEFEN_TITAN_TRACEBACK=1 shows" in line)
    assert len(tail) <= TORCHRUN_OWN + 2 * block + 1, "\n".join(tail)
    return ours[0]


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    """A run folder whose checkpoint folder holds the stored step-3 checkpoint."""
    dump = tmp_path_factory.mktemp("fixture_run")
    shutil.copytree(FIXTURE, dump / "checkpoint" / "step-3")
    return dump


def test_mistyped_recipe_key(tmp_path):
    recipe = tmp_path / "typo.toml"
    recipe.write_text(f'[job]\nextends = "{ROOT / "recipes" / "llama_gefen.toml"}"\n\n[optimizer]\nlrr = 1e-3\n')
    rc, out = launch("--job.config", str(recipe))
    check_reported(rc, out, "[optimizer] lrr: unknown key")


def test_missing_recipe():
    rc, out = launch("--job.config", "recipes/llama_gefn.toml")
    check_reported(rc, out, "recipe file not found", "llama_gefen.toml")


def test_initial_load_path_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "not_a_checkpoint").mkdir()
    rc, out = launch("--job.config", "recipes/llama_gefen.toml", "--job.dump_folder", str(tmp_path / "run"),
                     "--checkpoint.initial_load_path", str(tmp_path / "not_a_checkpoint"))
    check_reported(rc, out, "is not a checkpoint: it has no .metadata")
    assert "Building" not in out  # refused before anything was built


def test_another_model_flavor(fixture_run):
    rc, out = launch("--job.config", "recipes/llama_gefen.toml", "--job.dump_folder", str(fixture_run),
                     "--training.steps", "5", "--model.flavor", "150M")
    check_reported(rc, out, "written for another model", "--model.flavor", "initial_load_model_only",
                   "exclude_from_loading")


def test_gefen_checkpoint_loaded_as_adamw(fixture_run):
    rc, out = launch("--job.config", "recipes/llama_gefen.toml", "--job.dump_folder", str(fixture_run),
                     "--training.steps", "5", "--optimizer.name", "AdamW")
    check_reported(rc, out, "saved by Gefen and the recipe gives them to AdamW",
                   f"gefen-titan ckpt convert {fixture_run}/checkpoint/step-3", "--to adamw")


def test_truncated_data_file(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from gefen_titan.data import corpus
    from gefen_titan.data.indexed import TOKENS_FILE
    from gefen_titan.data.indexed_build import build_indexed_dataset

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Document {i}: " + "word " * (i % 40 + 20)}) + "\n"
                            for i in range(200)))
    data = tmp_path / "data"
    build_indexed_dataset([docs], HuggingFaceTokenizer(tokenizer_path=corpus.DEFAULT_TOKENIZER_PATH), data,
                          progress=False)
    tokens = data / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-2])
    rc, out = launch("--job.config", "recipes/llama_gefen_global_order.toml", "--job.dump_folder",
                     str(tmp_path / "run"), "--dataloader.dataset_path", str(data))
    check_reported(rc, out, "truncated")


def test_nothing_left_to_train_says_so_and_exits_0(fixture_run):
    rc, out = launch("--job.config", "recipes/llama_gefen.toml", "--job.dump_folder", str(fixture_run),
                     "--training.steps", "2")
    assert rc == 0, out[-3000:]
    said = [line for line in out.splitlines() if "nothing to train" in line]
    assert len(said) == 1 and "is at step 3" in said[0] and "raise --training.steps above 3" in said[0], out
    assert "Building" not in out and "decay_steps" not in out
