"""Verify = load, by construction (issue 38, item 2): for every check of ``load_checks.CHECKS`` one
planted violation, and ``ckpt verify`` and the resume agree on it.

One process. A tiny model with Gefen state (format v3), a data loader's
pickled state and a byte entry of its own, saved by GefenCheckpointManager
(digests, raw entries) once per module; each case copies the folder and
plants one violation as a writer without the save's key could (``.digests``
rewritten to match, ``tests.helpers.untrusted``), or saves the bad
component itself, or edits the records through DCP's own writer (no
``.digests``: only the record checks stand in the way). Then:

* ``verify`` fails, naming the planted check among its problems;
* the resume (a fresh manager's ``load``) refuses, before anything reaches
  the model or the optimizer;
* the unedited copy passes both (so each refusal is its plant's);
* a metadata-stage plant (a 2^50-element tensor, an item 8 GiB past its
  file's end, a byte item of 1 PiB, ...) is refused by ``inspect`` (a
  problem line, nothing read) and ``export``'s whole read
  (``storage.load_all``) before they allocate.

``test_every_check_has_a_planted_case`` fails when a check is added to
``CHECKS`` without a case here. Removing a check's code fails its case: the
check's name no longer appears in ``verify``'s problems, or the resume
loads.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_titan.checkpoint.checks import load_checks, metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.inspection import inspect_checkpoint
from gefen_titan.ckpt_tools.inspection import render as render_inspection
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from tests.helpers.bad_checkpoints import edited
from tests.helpers.tiny_checkpoint import STEP, Loader, build, edit_metadata, manager, resume, save
from tests.helpers.untrusted import Payload, replace_item, rewrite_digests

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

WEIGHT = "0.weight"  # the model's (torchtitan flattens it to the top): a framed float32 tensor of (16, 16)


def _item(md, key: str):
    (index,) = [i for i in md.storage_data if i.fqn == key]
    return index


def _flip_a_byte(step: Path) -> None:
    md = storage.read_metadata(step)
    info = md.storage_data[_item(md, WEIGHT)]
    f = step / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset + info.length // 2] ^= 1
    f.write_bytes(bytes(data))


def _append(step: Path) -> None:
    md = storage.read_metadata(step)
    f = step / md.storage_data[_item(md, WEIGHT)].relative_path
    f.write_bytes(f.read_bytes() + b"\0" * 16)


def _chunk_outside(md) -> None:
    md.state_dict_metadata[WEIGHT].chunks[0].sizes = torch.Size([17, 16])


def _gap(md) -> None:
    md.state_dict_metadata[WEIGHT].size = torch.Size([32, 16])


def _unstored(md) -> None:
    del md.storage_data[_item(md, WEIGHT)]


def _past_end(md) -> None:
    """The last byte item 8 GiB past its file's end, and the model's item 16 GiB past it and 1 PiB long
    (disjoint: only the file's size tells)."""
    byte_items = [i for i in md.storage_data if not isinstance(md.state_dict_metadata[i.fqn], TensorStorageMetadata)]
    md.storage_data[max(byte_items, key=lambda i: md.storage_data[i].offset)].offset += 8 << 30
    weight = md.storage_data[_item(md, WEIGHT)]
    weight.offset, weight.length = weight.offset + (16 << 30), 1 << 50


def _short_raw_item(md) -> None:
    key = "optimizer." + gefen_keys.qcodes_key("0.weight")
    md.storage_data[_item(md, key)].length -= 1


def _declared_huge(md) -> None:  # 2^50 elements declared, 1 KiB stored
    md.state_dict_metadata[WEIGHT].size = torch.Size([1 << 46, 16])


def _int32(md) -> None:  # the same item size, another dtype: only the stored tensor tells
    md.state_dict_metadata[WEIGHT].properties.dtype = torch.int32


def _records(opt_sd) -> None:
    for key in [k for k in opt_sd if schema.parse_key(k) and schema.parse_key(k).kind == "gefen"]:
        rec = json.loads(opt_sd[key])
        rec["global_step"] = 0  # below its parameters' step (1)
        opt_sd[key] = json.dumps(rec)


def _orphan_grid(opt_sd) -> None:  # state of a parameter no record names: only the records stage sees it
    opt_sd[schema.PATTERNS["grid"].format(fqn="ghost.weight")] = torch.ones(2, 2)


def _nan_codebook(opt_sd) -> None:
    key = next(k for k in opt_sd if schema.parse_key(k) and schema.parse_key(k).kind == "codebook")
    cb = opt_sd[key].clone()
    cb[128] = float("nan")
    opt_sd[key] = cb


def _fifo_digests(step: Path) -> None:  # a reader that opened it would block until a writer came
    (step / ".digests").unlink()
    os.mkfifo(step / ".digests")


def _deep_metadata(step: Path) -> None:  # a dict key nesting a tuple 10^6 deep: hashing it segfaulted readers
    md = storage.read_metadata(step)
    (step / ".metadata").write_bytes(b"\x80\x04}" + b"N" + b"\x85" * 1_000_000 + b"Ns.")
    rewrite_digests(step, md)


def _step_of_2_to_63(step: Path) -> None:  # beyond 2^53 (entry_values), in place of the step the folder names
    buf = io.BytesIO()
    torch.save(1 << 63, buf)
    replace_item(step, "train_state.step", buf.getvalue())


def _size_an_int(md) -> None:  # DCP writes a torch.Size; the other checks would raise TypeError on an int
    md.state_dict_metadata[WEIGHT].size = 16


# check -> (how the case is made, a text the resume's refusal holds). How: ("copy", plant(step)),
# ("metadata", change(md)), ("save", loader/note kwargs), ("records", edit(opt_sd)), ("step", None).
CASES: dict[str, tuple[str, object, str]] = {
    "regular files": ("copy", _fifo_digests, ".digests is a FIFO (named pipe), not a regular file"),
    "pickle budgets": ("copy", _deep_metadata, ".metadata: objects nested more than 64 deep"),
    "metadata fields": ("metadata", _size_an_int, f"entry {WEIGHT}: its size is int, not a flat tuple of ints"),
    "digests": ("copy", _flip_a_byte, "digest mismatch"),
    "digests present": ("copy", lambda step: (step / ".digests").unlink(), ".digests: missing"),
    "stray bytes": ("copy", _append, "bytes after its last item"),
    "chunks inside tensors": ("metadata", _chunk_outside, "[chunks inside tensors]"),
    "chunks tile": ("metadata", _gap, "[chunks tile]"),
    "chunks stored": ("metadata", _unstored, "[chunks stored]"),
    "items inside files": ("metadata", _past_end, "[items inside files]"),
    "item sizes": ("metadata", _short_raw_item, "[item sizes]"),
    "allocation": ("metadata", _declared_huge, "[allocation]"),
    "byte entries": ("save", {"note": "payload"}, "entry extra.note names io.open"),
    "loader states": ("save", {"loader": "payload"}, "dataloader.dp_rank_0 names io.open"),
    "stored tensors": ("metadata", _int32, "[stored tensors]"),
    "step binding": ("step", None, "its train_state.step is 1, and its folder is step-2"),
    "entry values": ("copy", _step_of_2_to_63, "entry train_state.step is 9,223,372,036,854,775,808, outside"),
    # The state adapters refuse these two first, naming the parameter (model-aware, as before);
    # verify names the records stage's check of them.
    "records": ("records", _records, "0.weight: global step 0 < parameter step 1"),
    "codebooks": ("records", _nan_codebook, "gefen/codebook/0.weight is corrupt"),
    "record tensors": ("records", _orphan_grid, "gefen/grid/ghost.weight belongs to no optimizer record "
                                                "[record tensors]"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("saved")).parents[1]


def _plant(saved: Path, tmp_path: Path, check: str) -> tuple[Path, int, Path]:
    """(root, step to resume, step folder) of ``check``'s case."""
    how, what, _ = CASES[check]
    root = tmp_path / "case"
    if how == "save":
        sentinel = tmp_path / "pwned"
        kw = {k: Payload(sentinel) for k in what}
        if "loader" in kw:
            kw["loader"] = Loader(kw["loader"])
        return root, STEP, save(root, **kw)
    if how == "records":
        edited(saved, root, STEP, what)
        return root, STEP, root / "ckpt" / f"step-{STEP}"
    step = root / "ckpt" / f"step-{STEP + (how == 'step')}"
    shutil.copytree(saved / "ckpt" / f"step-{STEP}", step)
    if how == "copy":
        what(step)
    elif how == "metadata":
        edit_metadata(step, what)
    return root, STEP + (how == "step"), step


def test_every_check_has_a_planted_case():
    assert set(CASES) == {c.name for c in load_checks.CHECKS}


def test_the_unedited_copy_passes_verify_and_resumes(saved, tmp_path):
    step = tmp_path / "case" / "ckpt" / f"step-{STEP}"
    shutil.copytree(saved / "ckpt" / f"step-{STEP}", step)
    report = verify_checkpoint(str(step))
    assert report["ok"] and report["verdict"] == "verified", report["problems"]
    net, opt = resume(tmp_path / "case")
    assert torch.equal(net[0].weight, storage.load_all(step)[WEIGHT])
    assert all(gx.global_step(o) == STEP for o in opt.optimizers)


@pytest.mark.parametrize("check", sorted(CASES))
def test_verify_and_the_resume_agree(saved, tmp_path, check):
    root, resume_step, step = _plant(saved, tmp_path, check)
    report = verify_checkpoint(str(step))
    checks = {p.get("check") for p in report["problems"]}
    assert not report["ok"] and check in checks, report["problems"]
    net, opt = build(5)
    before = [p.detach().clone() for p in net.parameters()]
    note = "" if CASES[check][1] == {"note": "payload"} else None  # the saved entry's layout (DCP flattens it)
    with pytest.raises(GefenCheckpointError) as refused:
        manager(root, net, opt, note=note).load(step=resume_step)
    assert CASES[check][2] in str(refused.value), str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # nothing reached the model
    assert all(gx.codebook(o) is None for o in opt.optimizers)  # nor the optimizer
    assert not (tmp_path / "pwned").exists()
    if next(c.stage for c in load_checks.CHECKS if c.name == check) == "metadata":
        # Refused before anything is read: export's whole read and inspect too (a read of 2^50
        # elements or of a 1 PiB item would fail to allocate, with another message than this).
        assert any(f"[{check}]" in p for p in inspect_checkpoint(str(step))["problems"])
        with pytest.raises(GefenCheckpointError, match=re.escape(f"[{check}]")):
            storage.load_all(step)


def test_a_reader_checks_each_item_against_its_file_before_allocating(saved, tmp_path):
    """Pins the reader's own "items inside files" check (``item_reads.ItemReads._read_and_check``), which holds for a
    reader made without the whole load's checks (``storage.storage_reader``: ``read_small``, the tools)
    and for a file cut after the metadata stage ran: the 1 PiB item is refused by its file's size, not
    by a failed allocation."""
    _, _, step = _plant(saved, tmp_path, "items inside files")
    target = {WEIGHT: torch.empty(16, 16)}
    with pytest.raises(BaseException, match=re.escape("it lies past the end of its file") + ".*items inside files"):
        dcp.load(target, storage_reader=storage.storage_reader(step), no_dist=True)


@pytest.mark.parametrize("era", ["digests", "unchecked"])
def test_an_item_cut_short_is_refused_naming_its_entry(saved, tmp_path, era):
    """An item's length cut by one byte in ``.metadata``. With ``.digests`` (rewritten to match) the byte
    left between two items is stray (``storage.stray_bytes``: a save writes items back to back); without,
    (``.digests`` deleted, loaded with ``load_without_digests``) the item does not decode and the reader
    names its file and entry (not a bare ``RuntimeError``)."""
    step = tmp_path / "case" / "ckpt" / f"step-{STEP}"
    shutil.copytree(saved / "ckpt" / f"step-{STEP}", step)

    def cut(md):
        md.storage_data[_item(md, "lr_scheduler.last_epoch")].length -= 1
    edit_metadata(step, cut)
    if era == "unchecked":
        (step / ".digests").unlink()
    text = ("lie in no item (the end of entry lr_scheduler.last_epoch's item" if era == "digests" else
            "entry lr_scheduler.last_epoch: does not load")
    with pytest.raises(GefenCheckpointError, match=re.escape(text)):
        resume(tmp_path / "case", load_without_digests=(era == "unchecked"))
    report = verify_checkpoint(str(step))
    assert not report["ok"] and any(p["entry"] == "lr_scheduler.last_epoch" or "lr_scheduler.last_epoch" in p["what"]
                                    for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("chunks, why", [
    ([((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 3))], None),
    ([((0, 0), (2, 6)), ((2, 0), (2, 3))], "its chunks hold 18 elements of its 24"),
    ([((0, 0), (2, 6)), ((1, 0), (2, 6))], "its chunks overlap"),  # as many elements as the tensor: row 3 uncovered
    ([((0, 0), (2, 6)), ((2, 0), (2, 6)), ((4, 0), (0, 6))], None),  # an empty chunk holds nothing
])
def test_chunks_tile_their_tensor(chunks, why):
    """The "chunks tile" check on a (4, 6) tensor (each chunk in a file of its own, as each rank writes its
    own)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
    )

    cs = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([4, 6]), cs)
    md = Metadata({"t": entry}, storage_data={
        MetadataIndex("t", torch.Size(o)): _StorageInfo(f"f{i}", 0, 50) for i, (o, _) in enumerate(chunks)})
    problems = metadata_checks.metadata_problems(md, lambda name: 1000)
    assert [p.what for p in problems if p.check == "chunks tile"] == ([why] if why else []), problems
    # The same chunks in one data file: more chunks than files is no save's layout (one chunk of an entry
    # per rank), refused before the tiling is computed (its cost grows with the chunks).
    md.storage_data = {MetadataIndex("t", torch.Size(o)): _StorageInfo("f", 100 * i, 50)
                       for i, (o, _) in enumerate(chunks)}
    problems = metadata_checks.metadata_problems(md, lambda name: 1000)
    assert [p.what for p in problems if p.check == "chunks tile"] == [
        f"{len(chunks)} chunks, and the save wrote 1 data file(s) (each rank writes one chunk of an entry)"]


def test_an_entry_of_no_known_kind_fails_verify_and_the_resume_and_inspect_flags_it(saved, tmp_path):
    """State in Gefen's namespace of a kind this version does not know (a later version's kind, or an
    edit) would be dropped without a word by a load that skips what it cannot parse: it is a problem
    of the records stage (``record tensors``), for the resume and ``verify`` alike, and a warning of
    ``inspect`` (not one of its problems: the rest of the checkpoint is shown as it is)."""
    edited(saved, tmp_path / "case", STEP, lambda opt_sd: opt_sd.__setitem__("gefen/later_kind/0.weight",
                                                                             torch.ones(4)))
    step = tmp_path / "case" / "ckpt" / f"step-{STEP}"
    text = "gefen/later_kind/0.weight: an entry of kind 'later_kind', which this gefen-titan does not know"
    report = verify_checkpoint(str(step))
    assert not report["ok"] and any(p.get("check") == "record tensors" and text in p["what"]
                                    for p in report["problems"]), report["problems"]
    with pytest.raises(GefenCheckpointError, match=re.escape(text)):
        resume(tmp_path / "case")
    report = inspect_checkpoint(str(step))
    assert any(text in w for w in report["warnings"]) and not any(text in p for p in report["problems"])
    assert f"WARNING     {text}" in render_inspection(report)


def test_the_tiling_check_is_not_quadratic_in_the_chunk_count():
    """200,000 one-element chunks of one tensor (a hostile ``.metadata``: issue 50) took rank 0 minutes in
    the tiling check (a list search per chunk) while the other rank timed out; the check is now linear in
    the chunks after one sort of the cuts. Generous bound: it takes about a second; the quadratic one took
    18 s at 40,000 chunks."""
    import time

    n = 200_000
    chunks = [((i,), (1,)) for i in range(n)]
    chunks.reverse()  # cut values out of order
    t = time.perf_counter()
    assert metadata_checks._cover_once((n,), chunks) is None
    dup = [*chunks[:-1], ((5,), (1,))]  # element 0 left out, element 5 held twice
    assert metadata_checks._cover_once((n,), dup) == "its chunks overlap"
    assert time.perf_counter() - t < 60
