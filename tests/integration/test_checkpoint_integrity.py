"""A flipped byte anywhere in a checkpoint is refused by the resume, on every rank, before anything live changes.

One 2-rank train.py run of ``recipes/llama_gefen.toml`` saves steps 2 and
4. Single random bytes (seeded) are flipped in copies of it, spread over
every file of step 4 (each rank's data file, ``.metadata``, ``.digests``),
one flip a copy. Then:

* one launch of 2 ranks builds the recipe's trainer once and resumes each
  copy through its checkpoint manager: every one is refused on both ranks
  with the file, the entry and ``--checkpoint.load_step 2`` in the error,
  and the live parameters, optimizer state and step are as they were;
  step 2 of a flipped copy still loads;
* ``gefen-titan ckpt verify`` names the flipped file of each copy;
* one real ``train.py`` resume of a flipped copy fails with that error
  (rank 0's block and torchrun's Root Cause, no traceback) and trains no step.

The untrusted folders (issues 27 and 38) go through the same launch: a
missing, cut or extended ``.digests``, stray bytes, an unlisted file, a
payload in ``.metadata``, in ``train_state.step`` (rank 0's file: rank 1
gets the refusal through DCP's gather, so it must pickle) and in rank 1's
data loader state, and step 2's files under ``step-4`` (step binding); a
real ``train.py`` resume of the ``train_state.step`` payload fails naming
the entry and the global (the same message on both ranks).
"""

import io
import json
import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import gefen_titan.train
from gefen_titan.checkpoint.format import digests
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from tests.helpers import processes
from tests.helpers.integrity_worker import resume_flipped
from tests.helpers.tiny_checkpoint import edit_metadata
from tests.helpers.untrusted import Payload, plant_in_metadata, replace_item, rewrite_digests

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["--job.config", "recipes/llama_gefen.toml", "--checkpoint.interval", "2"]
SEED = 19
FLIPS_PER_FILE = 4
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The run's dump folder: ``checkpoint/step-2`` and ``checkpoint/step-4``."""
    dump = tmp_path_factory.mktemp("saved")
    processes.run_ranks(2, gefen_titan.train.main, [*RECIPE, "--job.dump_folder", str(dump), "--training.steps", "4"],
                        logs=dump / "logs", timeout=600)
    return dump


def flip_copies(saved: Path, root: Path) -> list[tuple[Path, str, int]]:
    """(copy's checkpoint folder, flipped file, offset) for each flip: step 4's files, ``FLIPS_PER_FILE`` each.

    Unchanged files are hard links (a copy costs no disk); the flipped one
    is a real copy with one byte XORed with a random non-zero value.
    """
    rng = random.Random(SEED)
    src = saved / "checkpoint"
    names = sorted(os.listdir(src / "step-4"))
    assert {digests.METADATA_FILE, digests.FILE, "__0_0.distcp", "__1_0.distcp"} <= set(names), names
    out = []
    for name in names:
        size = (src / "step-4" / name).stat().st_size
        for k in range(FLIPS_PER_FILE):
            folder = root / f"{name.strip('.')}-{k}" / "checkpoint"
            shutil.copytree(src, folder, copy_function=os.link)
            target = folder / "step-4" / name
            data = bytearray(target.read_bytes())
            target.unlink()  # break the hard link: the source stays intact
            offset = rng.randrange(size)
            data[offset] ^= rng.randrange(1, 256)
            target.write_bytes(bytes(data))
            out.append((folder, name, offset))
    return out


def test_every_flipped_byte_is_refused(saved, tmp_path):
    copies = flip_copies(saved, tmp_path / "copies")
    # The intact checkpoint is verified clean and carries digests.
    clean = verify_checkpoint(str(saved / "checkpoint" / "step-4"))
    assert clean["ok"] and clean["digests"] and clean["checked"]["digests_checked"] == clean["checked"]["items"]

    out = tmp_path / "out"
    out.mkdir()
    argv = [*RECIPE, "--job.dump_folder", str(tmp_path / "dump"), "--copies", str(out), "4", "2",
            *(str(folder) for folder, _, _ in copies)]
    processes.run_ranks(2, resume_flipped, argv, logs=tmp_path / "logs", timeout=900)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    refused = 0
    for i, (folder, name, offset) in enumerate(copies):
        for r, seen in enumerate(ranks):
            v = seen["flips"][i]
            assert not v["loaded"], f"rank {r} loaded {name} flipped at byte {offset}"
            assert v["unchanged"], f"rank {r}: live state changed by the refused load of {name}@{offset}"
            assert "is corrupt" in v["error"] and name in v["error"], v["error"]
            assert "--checkpoint.load_step 2" in v["error"], v["error"]
        report = verify_checkpoint(str(folder / "step-4"))
        assert not report["ok"] and report["first_bad_file"] == name, (name, offset, report["problems"])
        refused += 1
    assert all(seen["previous_step"] == 2 for seen in ranks)  # the older step of a flipped copy still resumes
    assert refused == len(copies) == FLIPS_PER_FILE * 4
    print(f"{refused} of {len(copies)} single-byte flips refused on both ranks and named by verify")

    # End to end: a real train.py resume of a flipped data file fails on both ranks and trains nothing.
    folder, name, _ = next(c for c in copies if c[1] == "__1_0.distcp")
    proc = processes.torchrun(2, str(ROOT / "train.py"), *RECIPE, "--job.dump_folder", str(folder.parent),
                              "--training.steps", "6", timeout=600)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode != 0, log[-3000:]
    assert not STEP_RE.search(log), log[-3000:]
    # rank 0's block and torchrun's Root Cause (from a rank's error file): the user's error, no traceback
    errors = re.findall(r"gefen-titan: error: .*is corrupt: " + re.escape(name) + r".*", log)
    assert len(errors) >= 2 and "GefenCheckpointError" in log, log[-5000:]
    assert "--checkpoint.load_step 2" in errors[0]


def _untrusted_copies(saved: Path, root: Path, sentinel: Path) -> list[tuple[Path, str, str]]:
    """(copy's checkpoint folder, what was done, the text its refusal must hold): step 4 damaged one way each."""
    def copy(name: str) -> Path:
        folder = root / name / "checkpoint"
        shutil.copytree(saved / "checkpoint", folder, copy_function=shutil.copy2)
        return folder

    out = []
    folder = copy("no-digests")
    (folder / "step-4" / digests.FILE).unlink()
    out.append((folder, "no .digests", "checkpoint.load_without_digests"))
    folder = copy("short-digests")
    raw = (folder / "step-4" / digests.FILE).read_bytes()
    (folder / "step-4" / digests.FILE).write_bytes(raw[:-7])
    out.append((folder, "truncated .digests", digests.FILE))
    folder = copy("long-digests")
    with open(folder / "step-4" / digests.FILE, "ab") as f:
        f.write(b"0 8 0123456789abcdef\n")
    out.append((folder, "extended .digests", digests.FILE))
    folder = copy("appended")
    with open(folder / "step-4" / "__1_0.distcp", "ab") as f:
        f.write(os.urandom(64))
    out.append((folder, "64 bytes appended to a data file", "bytes after its last item"))
    folder = copy("unlisted")
    shutil.copy(folder / "step-4" / "__1_0.distcp", folder / "step-4" / "__2_0.distcp")
    out.append((folder, "an unlisted data file", "__2_0.distcp"))
    # Issue 38: refusals raised on one rank reach the other intact (they pickle), step binding.
    folder = copy("step-payload")  # rank 0's file: rank 1 learns of it through DCP's gather
    replace_item(folder / "step-4", "train_state.step", _pickled(Payload(sentinel)))
    out.append((folder, "a payload in train_state.step", "entry train_state.step names io.open"))
    folder = copy("loader-payload")  # rank 1's own loader state, the pickle inside the byte entry
    replace_item(folder / "step-4", "dataloader.dp_rank_1", _pickled(pickle.dumps(Payload(sentinel))))
    out.append((folder, "a payload in rank 1's loader state", "dataloader.dp_rank_1 names io.open"))
    folder = copy("replayed")  # a signed step's files under a later step's folder
    shutil.rmtree(folder / "step-4")
    shutil.copytree(folder / "step-2", folder / "step-4")
    out.append((folder, "step 2's files as step 4", "its train_state.step is 2, and its folder is step-4"))
    # Issue 50: the read stage (special files, pickle budgets, field types) and the chunk bound, on every
    # rank: each rank reads .metadata itself, so a field of the wrong type no longer fails on rank 0 alone.
    folder = copy("fields")
    edit_metadata(folder / "step-4", lambda md: setattr(md, "storage_data", list(md.storage_data.items())))
    out.append((folder, "storage_data as a list", "storage_data is list, not a dict [metadata fields]"))
    folder = copy("deep")  # a dict key nesting a tuple 10^6 deep: hashing it segfaulted the reader
    md = storage.read_metadata(folder / "step-4")
    (folder / "step-4" / ".metadata").write_bytes(b"\x80\x04}" + b"N" + b"\x85" * 1_000_000 + b"Ns.")
    rewrite_digests(folder / "step-4", md)
    out.append((folder, "a 10^6-deep tuple in .metadata", "objects nested more than 64 deep"))
    folder = copy("fifo")
    (folder / "step-4" / digests.FILE).unlink()
    os.mkfifo(folder / "step-4" / digests.FILE)
    out.append((folder, ".digests as a FIFO", "is a FIFO (named pipe), not a regular file"))
    folder = copy("chunks")
    edit_metadata(folder / "step-4", _many_chunks)
    out.append((folder, "200,000 chunks of one tensor", "200,000 chunks, and the save wrote 2 data file(s)"))
    folder = copy("bomb")  # rank 1's loader state, deflated (torch.save stores members uncompressed)
    replace_item(folder / "step-4", "dataloader.dp_rank_1", _deflated(_pickled(b"\0" * (8 << 20))))
    out.append((folder, "a deflated byte entry", "is compressed"))
    folder = copy("payload")  # last: the end-to-end resume below
    rewrite_digests(folder / "step-4", plant_in_metadata(folder / "step-4", sentinel))
    out.append((folder, "a payload in .metadata, .digests rewritten to match", ".metadata names io.open"))
    return out


def _many_chunks(md) -> None:
    """One small tensor declared as 200,000 one-element chunks: the tiling check was quadratic in them."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    key = next(k for k, e in md.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata))
    md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(torch.Size([i] + [0] * (len(
        md.state_dict_metadata[key].size) - 1)), torch.Size([1] * len(md.state_dict_metadata[key].size)))
        for i in range(200_000)]


def _deflated(archive: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for member in src.infolist():
            dst.writestr(member.filename, src.read(member))
    return out.getvalue()


def _pickled(value) -> bytes:
    """A byte entry's item as DCP writes it (``torch.save`` of the value)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_untrusted_folders_are_refused_on_every_rank_and_run_nothing(saved, tmp_path):
    """Issue 27's acceptance on a real 2-rank checkpoint: each damage is refused on both ranks by the
    resume (live state unchanged) and fails ``ckpt verify``; the planted payload runs nowhere, in the
    resume, ``ckpt inspect``, ``verify`` or ``convert``."""
    from gefen_titan.ckpt_tools import convert, inspection

    sentinel = tmp_path / "pwned"
    copies = _untrusted_copies(saved, tmp_path / "copies", sentinel)
    out = tmp_path / "out"
    out.mkdir()
    argv = [*RECIPE, "--job.dump_folder", str(tmp_path / "dump"), "--copies", str(out), "4", "2",
            *(str(folder) for folder, _, _ in copies)]
    processes.run_ranks(2, resume_flipped, argv, logs=tmp_path / "logs", timeout=900)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for i, (folder, what, text) in enumerate(copies):
        for r, seen in enumerate(ranks):
            v = seen["flips"][i]
            assert not v["loaded"], f"rank {r} loaded the copy with {what}"
            assert v["unchanged"], f"rank {r}: live state changed by the refused load of the copy with {what}"
            assert text in v["error"], (what, v["error"])
        report = verify_checkpoint(str(folder / "step-4"))
        assert report["verdict"] == "failed", (what, report["problems"])
    assert all(seen["previous_step"] == 2 for seen in ranks)
    payload = copies[-1][0] / "step-4"  # the .metadata payload
    for tool in (lambda: inspection.inspect_checkpoint(str(payload)),
                 lambda: convert.convert(str(payload), str(tmp_path / "converted"), "adamw")):
        with pytest.raises(Exception, match="io.open"):
            tool()
    # End to end (issue 38's acceptance): a real train.py resume of the copy with a payload in rank 0's
    # train_state.step fails on both ranks, each naming the entry and the global, and trains nothing.
    # (The .metadata payload's refusal on both ranks is the launch's above.)
    step_payload = next(folder for folder, what, _ in copies if what == "a payload in train_state.step")
    proc = processes.torchrun(2, str(ROOT / "train.py"), *RECIPE, "--job.dump_folder", str(step_payload.parent),
                              "--training.steps", "6", timeout=600)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode != 0 and not STEP_RE.search(log), log[-3000:]
    # rank 0's block and torchrun's Root Cause, from whichever rank failed first: the message is
    # the same on both (rebuilt intact on rank 1)
    refusals = re.findall(r"gefen-titan: error: .*entry train_state\.step names io\.open", log)
    assert len(refusals) >= 2 and "TypeError" not in log, log[-5000:]
    assert not sentinel.exists()
