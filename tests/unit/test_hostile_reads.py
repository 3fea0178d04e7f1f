"""Hostile checkpoints, third pass (issue 50): bounded reads, pickle budgets, field types, checks that
cannot crash one rank.

Each case copies the tiny checkpoint of ``tests.helpers.tiny_checkpoint``
and plants what an attacker who can write the folder (and rewrite an
unkeyed ``.digests`` to match) can plant: special files, sparse files,
pickles of allowed types that nest, share or count beyond reason, a deflate
bomb in a byte entry, metadata fields of the wrong type. ``verify`` and the
resume run in a child process where a regression would hang, segfault or
exhaust memory (so the test fails instead of taking the suite down), under
a timeout, with the child's peak resident memory compared with a clean
verify's.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

from gefen_titan.checkpoint.checks import metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digests, pickle_budget, unpickling
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from tests.helpers.tiny_checkpoint import STEP, build, edit_metadata, manager, save
from tests.helpers.untrusted import as_pre_digest, digest_rows, replace_item, rewrite_digests

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # per child; each takes ~5 s here (torch's import), a hang or an unbounded read far more
EXTRA_RSS_MB = 256  # peak memory a hostile folder may add over a clean read's (measured +0..+128 MB here: a clean
# child's own peak varies by ~130 MB between launches, 634 vs 743 MB measured; 2026-12-06)

_CHILD = textwrap.dedent("""
    import json, resource, sys, warnings
    warnings.filterwarnings("ignore")
    from pathlib import Path
    for job in sys.argv[1:]:
        step, _, what = job.rpartition("::")
        step = Path(step)
        try:
            if what == "verify":
                from gefen_titan.ckpt_tools.verify import verify_checkpoint
                report = verify_checkpoint(str(step))
                out = {"ok": report["ok"], "message": " | ".join(p["what"] for p in report["problems"])}
            elif what == "export":
                from gefen_titan.checkpoint.io import storage
                storage.load_all(step)
                out = {"ok": True, "message": ""}
            else:
                from tests.helpers.tiny_checkpoint import build, manager
                net, opt = build(5)
                manager(step.parents[1], net, opt).load(step=int(step.name[5:]))
                out = {"ok": True, "message": ""}
        except Exception as e:
            out = {"ok": False, "message": f"{type(e).__name__}: {e}"}
        out["what"], out["step"] = what, str(step)
        out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(out), flush=True)
""")


def _child(jobs: list[tuple[Path, str]]) -> list[dict]:
    """Each (step folder, tool: verify, export or resume) in one child process, in turn: their results
    (with the child's peak resident memory so far), or the test fails on a hang, a crash (a segfault
    leaves no result line) or a traceback. One child for many: torch's import is most of its time."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *(f"{step}::{tool}" for step, tool in jobs)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(jobs), \
        f"crashed (rc {proc.returncode}) after {len(lines)} of {jobs}: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    out = [json.loads(line[len("RESULT "):]) for line in lines]
    out[-1]["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("saved"))


@pytest.fixture(scope="module")
def clean_rss(clean) -> float:
    """The peak memory of a clean verify, resume and export in one child: what a hostile case's is held to."""
    reports = _child([(clean, "verify"), (clean, "resume"), (clean, "export")])
    assert all(r["ok"] for r in reports), reports
    return reports[-1]["rss_mb"]


def _copy(clean: Path, tmp_path: Path) -> Path:
    step = tmp_path / "case" / "ckpt" / f"step-{STEP}"
    shutil.copytree(clean, step)
    return step


def _refused_everywhere(cases: list[tuple[Path, str]], clean_rss: float, tools: tuple[str, ...] = ("verify", "resume")):
    """Every (step folder, text) refused by each tool with ``text`` in its message, within the memory bound
    (the largest growth over a clean verify is printed: ``-s``)."""
    texts = {str(step): text for step, text in cases}
    results = _child([(step, tool) for step, _ in cases for tool in tools])
    for out in results:
        assert not out["ok"] and texts[out["step"]] in out["message"], out
        assert out["rss_mb"] < clean_rss + EXTRA_RSS_MB, (out, clean_rss)
    peak = max(r["rss_mb"] for r in results) - clean_rss
    print(f"\n{len(results)} refusals in {results[-1]['seconds']:.1f} s, peak memory {peak:+.0f} MB over a clean "
          "read's")


# ------------------------------------------------------------------ special and sparse files
def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def test_special_and_sparse_files_are_refused_by_name_before_a_read(clean, clean_rss, tmp_path):
    """A FIFO, a link to /dev/zero or a directory in place of each file (a reader would block, read
    forever, or fail with a traceback), and sparse files of GiBs (nothing on disk, GiBs if read whole)."""
    cases = []
    for name in (".digests", ".metadata", "__0_0.distcp"):
        for plant, what in ((_fifo, "a FIFO"), (_dev_zero, "a character device"), (_directory, "a directory")):
            step = _copy(clean, tmp_path / f"{name}-{what}")
            plant(step / name)
            cases.append((step, f"{step / name} is {what}"))
    step = _copy(clean, tmp_path / "sparse-metadata")
    os.truncate(step / ".metadata", 3 << 30)
    saved = digest_rows(clean, storage.read_metadata(clean))[0]
    cases.append((step, f"3,221,225,472 bytes, the save wrote {saved:,}"))  # refused on .digests' record
    step = _copy(clean, tmp_path / "sparse-metadata-no-digests")
    as_pre_digest(step)
    os.truncate(step / ".metadata", 3 << 30)
    cases.append((step, "allows at most 1,073,741,824"))  # the format's bound
    step = _copy(clean, tmp_path / "sparse-digests")
    os.truncate(step / ".digests", 1 << 30)  # the real header and index, then a GiB of holes
    cases.append((step, "bytes, its index accounts for"))
    step = _copy(clean, tmp_path / "long-index")
    header = (step / ".digests").read_bytes().split(b"\n", 1)[0]
    (step / ".digests").write_bytes(header + b"\n")
    os.truncate(step / ".digests", 1 << 30)  # a header, then an index line of a GiB (no newline in it)
    cases.append((step, "no digest header and index within its first 67,108,864 bytes"))
    step = _copy(clean, tmp_path / "holes-digests")
    os.truncate(step / ".digests", 0)
    os.truncate(step / ".digests", 1 << 30)  # only holes: no header line
    cases.append((step, "its first line is not a digest header"))
    _refused_everywhere(cases, clean_rss)


def test_a_section_that_claims_more_rows_than_metadata_stores_is_refused_unread(clean, tmp_path):
    step = _copy(clean, tmp_path)
    size, digest, rows = digest_rows(step, storage.read_metadata(step))
    file = sorted(rows)[0]
    for i in range(len(rows[file]) + 1, len(rows[file]) + 50):  # rows for items .metadata does not store
        rows[file][10**12 + i] = (1, "0" * 16)
    (step / digests.FILE).write_bytes(digests.Digests(size, digest, rows).to_bytes())
    with pytest.raises(GefenCheckpointError, match="rows, and .metadata stores"):
        storage.read_checked_metadata(step)


# ------------------------------------------------------------------ pickle budgets
def _write_metadata(step: Path, raw: bytes) -> None:
    md = storage.read_metadata(step)
    (step / ".metadata").write_bytes(raw)
    rewrite_digests(step, md)  # the items' rows as before, .metadata's size and digest of the new bytes


def test_a_million_deep_tuple_in_metadata_is_refused_not_a_segfault(clean, clean_rss, tmp_path):
    step = _copy(clean, tmp_path)
    # A dict whose key nests a tuple 10^6 deep: hashing it recursed in C until the reader segfaulted.
    _write_metadata(step, b"\x80\x04}" + b"N" + b"\x85" * 1_000_000 + b"Ns.")
    _refused_everywhere([(step, "objects nested more than 64 deep")], clean_rss, ("verify", "resume", "export"))


def test_a_string_copied_thousands_of_times_is_refused_quickly(clean, clean_rss, tmp_path):
    """One 750 KB string shared through the memo into 2,000 paths (an allowed constructor, which copies
    its argument per use): 286 KB of pickle cost 1.5 GB. Charged per copy inside the C unpickler."""
    step = _copy(clean, tmp_path)
    big = b"X" + (750_000).to_bytes(4, "little") + b"a" * 750_000
    path = b"\x8c\x07pathlib\x94\x8c\x09PosixPath\x94\x93\x94"  # memo 1, 2, 3 (the class)
    raw = b"\x80\x04]\x94" + path + b"0" + big + b"\x94" + b"0" + b"h\x03h\x04\x85Ra" * 2000 + b"."
    _write_metadata(step, raw)
    (out,) = _child([(step, "verify")])
    assert not out["ok"] and "objects copied more than the budget allows" in out["message"], out
    assert out["seconds"] < 60 and out["rss_mb"] < clean_rss + EXTRA_RSS_MB, out


def test_metadata_past_the_hash_safe_nesting_is_walked_first():
    """Below HASH_SAFE_NESTING tuple opcodes the C unpickler reads .metadata (copies charged); above it the
    opcode walk runs first and refuses what nests past its budget."""
    shallow = pickle.dumps({("a",) * 3: 1})
    assert unpickling.unpickle_metadata(shallow) == {("a",) * 3: 1}
    deep = b"\x80\x04}" + b"N" + b"\x85" * (unpickling.HASH_SAFE_NESTING + 1) + b"Ns."
    with pytest.raises(pickle_budget.OverBudgetError, match="nested more than 64 deep"):
        unpickling.unpickle_metadata(deep)


@pytest.mark.parametrize("raw, what", [
    (b"\x80\x04" + b"]" * 200 + b"a" * 199 + b".", "nested more than 64 deep"),
    (b"\x80\x04]\x94h\x00a.", "holds itself"),
    (b"\x80\x04]\x94\x85h\x00Na.", "filled after another one took it"),
    (b"\x80\x04" + b"N" * 10 + b"\x97.", "no checkpoint writer uses"),
    (b"\x80\x04h\x05.", "never put"),
])
def test_the_budget_refuses_each_shape_by_name(raw, what):
    with pytest.raises(pickle_budget.OverBudgetError, match=what):
        pickle_budget.check(raw, "entry dataloader.dp_rank_0", "/ckpt/step-1", pickle_budget.LOADER)
    with pytest.raises(pickle_budget.OverBudgetError):  # the loader's inner pickle goes through it
        unpickling.loads_loader_state(raw, "dataloader.dp_rank_0", "/ckpt/step-1")


def test_the_budget_passes_what_savers_write(clean):
    raw = (clean / ".metadata").read_bytes()
    pickle_budget.check(raw, ".metadata")  # DCP's own .metadata
    state = {"sampler": {"epoch": 3, "positions": list(range(5000))}, "names": ["a" * 100] * 50}
    pickle_budget.check(pickle.dumps(state), "entry dataloader.dp_rank_0", budget=pickle_budget.LOADER)


def test_a_deflate_bomb_in_a_byte_entry_is_refused_before_it_inflates(clean, clean_rss, tmp_path):
    step = _copy(clean, tmp_path)
    buf = io.BytesIO()
    torch.save(torch.zeros(64 << 20, dtype=torch.uint8), buf)  # 64 MiB stored
    bomb = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, \
            zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert len(bomb.getvalue()) < 1 << 20
    replace_item(step, "train_state.step", bomb.getvalue())
    _refused_everywhere([(step, "is compressed")], clean_rss)


# ------------------------------------------------------------------ field types
@pytest.mark.parametrize("change, text", [
    (lambda md: setattr(md.state_dict_metadata["0.weight"], "size", 16), "its size is int"),
    (lambda md: delattr(md.state_dict_metadata["0.weight"], "properties"), "its properties are"),
    (lambda md: setattr(md, "storage_data", list(md.storage_data.items())), "storage_data is list"),
    (lambda md: setattr(md.state_dict_metadata["0.weight"], "size", _deep_size()), "its size is tuple"),
    (lambda md: md.planner_data.update({"0.weight": ("a", 10**12)}), "neither a name nor a list index"),
    (lambda md: md.planner_data.update({k: (f"c{i}", len(md.state_dict_metadata)) for i, k in
                                        enumerate(md.planner_data)}), "would make a rebuild of the state dict grow"),
    (lambda md: setattr(md.storage_meta, "modules", "abc"), "storage_meta.modules is str"),
])
def test_a_field_of_the_wrong_type_is_refused_by_every_reader(clean, tmp_path, change, text):
    step = _copy(clean, tmp_path)
    edit_metadata(step, change)
    report = verify_checkpoint(str(step))
    assert not report["ok"] and "metadata fields" in [p["check"] for p in report["problems"]], report
    assert text in report["problems"][0]["what"], report["problems"]
    net, opt = build(5)
    with pytest.raises(GefenCheckpointError, match="metadata fields"):
        manager(step.parents[1], net, opt).load(step=STEP)
    with pytest.raises(GefenCheckpointError, match=text):
        storage.load_all(step)


def _deep_size():
    size: tuple = (16,)
    for _ in range(40):  # within the budget, and no flat tuple of ints
        size = (size,)
    return size


def test_a_check_that_raises_is_a_refusal_naming_it(clean, tmp_path, monkeypatch):
    """A check of the metadata stage runs on rank 0 alone: what it raises must become the load's verdict
    (agreed on every rank), never a lone traceback on that rank."""
    step = _copy(clean, tmp_path)

    def broken(*args, **kwargs):
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(metadata_checks, "metadata_problems", broken)
    net, opt = build(5)
    with pytest.raises(GefenCheckpointError, match=r"the metadata stage .* failed on it \(TypeError: 'int'"):
        manager(step.parents[1], net, opt).load(step=STEP)
