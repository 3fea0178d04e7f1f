"""Rebuild gefen_titan's embedded default corpus and tokenizer, offline.

Why this exists: the default recipe (torchtitan's Llama 3 ``debugmodel``,
vocab_size=2048) must train on a machine with no access to model or dataset
hubs, so the package ships a tiny corpus plus a BPE tokenizer trained on it.
This module (command line: ``scripts/build_assets.py``) is the single,
deterministic way those assets are produced.

Source: the CPython 3.11 standard library of the interpreter running this
script (``sysconfig.get_path("stdlib")``), PSF License Agreement v2 (a copy
of the interpreter's own LICENSE.txt is written next to the corpus).  We use

* the docstrings (module, class, function, method) of every stdlib ``.py``
  file, excluding test suites, ``site-packages``, the ``config-*`` build dir
  and the generated ``encodings/*`` codec modules; and
* the reference-manual topics in ``pydoc_data/topics.py`` (the text that
  ``help("assert")`` prints), read with ``ast.literal_eval`` (never executed).

Outputs (under ``--out-dir``, default ``gefen_titan/assets``):

* ``tiny_corpus/tiny_corpus.jsonl.gz``: one ``{"text": ...}`` JSON object per
  line, documents of 200..1500 characters, shuffled with a fixed seed;
  gzip header carries no file name and mtime 0, so the bytes are reproducible.
* ``tiny_corpus/LICENSE-PSF.txt``: the stdlib's LICENSE.txt, verbatim.
* ``tiny_corpus/build_info.json``: source, python version, counts, sha256s.
* ``tokenizer/tokenizer.json`` + ``tokenizer/tokenizer_config.json``: a
  byte-level BPE with exactly 2048 ids, ids 0/1 being the special tokens
  ``<|begin_of_text|>`` / ``<|end_of_text|>``, in the layout torchtitan's
  ``HuggingFaceTokenizer`` reads (it adds BOS/EOS itself, so the tokenizer
  has no post-processor that inserts them).

Usage::

    python scripts/build_assets.py            # rebuild in place
    python scripts/build_assets.py --check    # rebuild in a temp dir, diff

Determinism: same CPython patch version (the docstrings change between
releases) and same ``tokenizers`` version give byte-identical outputs; the
script warns when the interpreter differs from the one recorded in
build_info.json.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "gefen_titan" / "assets"

CORPUS_DIR = "tiny_corpus"
CORPUS_FILE = "tiny_corpus.jsonl.gz"
TOKENIZER_DIR = "tokenizer"

VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]  # -> ids 0 and 1

# Document shaping: units (one docstring / one topic) are split at paragraph
# boundaries to at most MAX_CHARS, then packed greedily up to MAX_CHARS; a new
# group (module docstring, top-level class or function, topic) starts a new
# document once the current one has SOFT_MIN_CHARS characters. Documents
# shorter than MIN_CHARS are dropped.
MAX_CHARS = 1500
SOFT_MIN_CHARS = 300
MIN_CHARS = 200
SHUFFLE_SEED = 20240611

# Path components we never read: test suites, third-party code, build config.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
EXCLUDED_PREFIXES = ("config-",)
# Generated codec tables: thousands of near-identical boilerplate docstrings.
EXCLUDED_SUBPACKAGES = ("encodings/",)
KEEP_ANYWAY = {"encodings/__init__.py"}
TOPICS_FILE = "pydoc_data/topics.py"


# --------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------


def iter_stdlib_files(stdlib: Path) -> list[str]:
    """Relative POSIX paths of the stdlib .py files we read, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = Path(dirpath).relative_to(stdlib)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_PREFIXES)
        ]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = (rel_dir / fn).as_posix()
            if rel == TOPICS_FILE or fn.startswith("_sysconfigdata"):
                continue
            if rel.startswith(EXCLUDED_SUBPACKAGES) and rel not in KEEP_ANYWAY:
                continue
            out.append(rel)
    return sorted(out)


def module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return "(" + ast.unparse(node.args) + ")"
    except Exception:  # pragma: no cover - ast.unparse handles all 3.11 syntax
        return "(...)"


def docstring_groups(rel: str, source: bytes) -> list[list[str]]:
    """The docstrings of one file as text units, in source order.

    One group for the module docstring and one per top-level class (its own
    docstring followed by those of its methods and nested classes) or
    function; groups are the natural document boundaries used by pack().
    Function bodies are not walked: inner helpers rarely carry useful docs.
    """
    try:
        tree = ast.parse(source, filename=rel)
    except SyntaxError:
        return []  # no such file in 3.11's Lib/ outside the excluded tests
    mod = module_name(rel)
    groups = []
    doc = ast.get_docstring(tree)
    if doc:
        groups.append([f"Module {mod}\n\n{doc}"])

    def walk(node, prefix: str, units: list[str]) -> None:
        if isinstance(node, ast.ClassDef):
            qual = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                units.append(f"class {qual}\n\n{doc}")
            for child in node.body:
                walk(child, qual, units)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                units.append(f"{prefix}.{node.name}{_signature(node)}\n\n{doc}")

    for node in tree.body:
        units: list[str] = []
        walk(node, mod, units)
        if units:
            groups.append(units)
    return groups


def topic_units(stdlib: Path) -> list[tuple[str, str]]:
    """(topic, text) pairs from pydoc_data/topics.py, sorted by topic."""
    tree = ast.parse((stdlib / TOPICS_FILE).read_bytes())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            topics = ast.literal_eval(node.value)
            return sorted((k, v.strip()) for k, v in topics.items())
    raise RuntimeError(f"no `topics = {{...}}` in {TOPICS_FILE}")


# --------------------------------------------------------------------------
# Document shaping
# --------------------------------------------------------------------------


def split_long(text: str, max_chars: int) -> list[str]:
    """Split at blank lines (then lines, then hard) into pieces <= max_chars."""
    if len(text) <= max_chars:
        return [text]
    pieces, cur = [], ""
    for para in text.split("\n\n"):
        sub = [para]
        if len(para) > max_chars:
            sub, line_cur = [], ""
            for line in para.split("\n"):
                while len(line) > max_chars:
                    if line_cur:
                        sub.append(line_cur)
                        line_cur = ""
                    sub.append(line[:max_chars])
                    line = line[max_chars:]
                if line_cur and len(line_cur) + 1 + len(line) > max_chars:
                    sub.append(line_cur)
                    line_cur = line
                else:
                    line_cur = f"{line_cur}\n{line}" if line_cur else line
            if line_cur:
                sub.append(line_cur)
        for p in sub:
            if cur and len(cur) + 2 + len(p) > max_chars:
                pieces.append(cur)
                cur = p
            else:
                cur = f"{cur}\n\n{p}" if cur else p
    if cur:
        pieces.append(cur)
    return pieces


def pack(groups: list[list[str]]) -> list[str]:
    """Greedy-pack units into documents, preferring to break between groups.

    Pieces seen before are skipped: the reference topics share sections
    (e.g. the special-method docs appear under several topics).
    """
    docs, cur = [], ""
    seen: set[str] = set()
    for group in groups:
        if cur and len(cur) >= SOFT_MIN_CHARS:
            docs.append(cur)
            cur = ""
        for unit in group:
            for piece in split_long(unit, MAX_CHARS):
                if piece in seen:
                    continue
                seen.add(piece)
                if cur and len(cur) + 2 + len(piece) > MAX_CHARS:
                    docs.append(cur)
                    cur = piece
                else:
                    cur = f"{cur}\n\n{piece}" if cur else piece
    if cur:
        docs.append(cur)
    docs = [d for d in docs if len(d) >= MIN_CHARS]
    return list(dict.fromkeys(docs))  # unique, first occurrence order


def build_documents(stdlib: Path) -> tuple[list[str], dict]:
    files = iter_stdlib_files(stdlib)
    seen: set[str] = set()
    groups = []
    n_docstrings = 0
    for rel in files:
        for group in docstring_groups(rel, (stdlib / rel).read_bytes()):
            units = []
            for unit in group:
                body = unit.split("\n\n", 1)[1]
                if body in seen:  # copied/inherited docstrings ("Return self.")
                    continue
                seen.add(body)
                units.append(unit)
            n_docstrings += len(units)
            if units:
                groups.append(units)
    topics = topic_units(stdlib)
    groups.extend([text] for _, text in topics)

    docs = pack(groups)
    for d in docs:
        for tok in SPECIAL_TOKENS:
            # Added tokens are matched in raw text at encode time; a literal
            # special token inside the corpus would turn into a real BOS/EOS.
            assert tok not in d, f"special token {tok!r} in corpus text"
    random.Random(SHUFFLE_SEED).shuffle(docs)
    stats = {
        "source_files": len(files),
        "docstrings_kept": n_docstrings,
        "topics": len(topics),
    }
    return docs, stats


def write_corpus(docs: list[str], path: Path) -> None:
    raw = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    buf = io.BytesIO()
    # filename="" and mtime=0: no build-dependent bytes in the gzip header.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw.encode("utf-8"))
    path.write_bytes(buf.getvalue())


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(docs: list[str]):
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level BPE: lossless on any UTF-8 text, no <unk>.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Offsets only; it inserts no tokens (torchtitan adds BOS/EOS itself).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def tokenizer_config() -> dict:
    def added(content: str) -> dict:
        return {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    return {
        "added_tokens_decoder": {"0": added(BOS_TOKEN), "1": added(EOS_TOKEN)},
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        # torchtitan's HuggingFaceTokenizer: encode() adds BOS/EOS only when
        # asked (the text dataset asks for both); transformers: same meaning.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(tok, out: Path) -> None:
    vocab = tok.get_vocab(with_added_tokens=True)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tok.get_vocab_size()
    assert max(vocab.values()) == VOCAB_SIZE - 1 and len(vocab) == VOCAB_SIZE
    assert tok.token_to_id(BOS_TOKEN) == 0 and tok.token_to_id(EOS_TOKEN) == 1
    tok.save(str(out / "tokenizer.json"), pretty=True)
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n"
    )


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out_dir: Path, stdlib: Path) -> dict:
    corpus_dir = out_dir / CORPUS_DIR
    tok_dir = out_dir / TOKENIZER_DIR
    corpus_dir.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    docs, stats = build_documents(stdlib)
    t_extract = time.perf_counter() - t0
    write_corpus(docs, corpus_dir / CORPUS_FILE)
    # An installed Lib/ carries LICENSE.txt; a CPython checkout has it one up.
    lic = next(
        (p for p in (stdlib / "LICENSE.txt", stdlib.parent / "LICENSE") if p.is_file()),
        None,
    )
    if lic is None:
        raise FileNotFoundError(f"no CPython LICENSE.txt in or above {stdlib}")
    shutil.copyfile(lic, corpus_dir / "LICENSE-PSF.txt")

    t0 = time.perf_counter()
    tok = train_tokenizer(docs)
    t_train = time.perf_counter() - t0
    write_tokenizer(tok, tok_dir)

    n_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    lengths = sorted(len(d) for d in docs)
    info = {
        "source": "CPython standard library docstrings + pydoc_data/topics.py",
        "license": "PSF-2.0 (see LICENSE-PSF.txt)",
        "python_version": sys.version.split()[0],
        "tokenizers_version": tokenizers.__version__,
        **stats,
        "documents": len(docs),
        "characters": sum(lengths),
        "doc_chars_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "tokens_without_bos_eos": n_tokens,
        "tokens_with_bos_eos": n_tokens + 2 * len(docs),
        "vocab_size": VOCAB_SIZE,
        "sha256": {
            f"{CORPUS_DIR}/{CORPUS_FILE}": sha256(corpus_dir / CORPUS_FILE),
            f"{TOKENIZER_DIR}/tokenizer.json": sha256(tok_dir / "tokenizer.json"),
            f"{TOKENIZER_DIR}/tokenizer_config.json": sha256(tok_dir / "tokenizer_config.json"),
        },
    }
    (corpus_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    print(f"extract: {t_extract:.2f}s  tokenizer training: {t_train:.2f}s", file=sys.stderr)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    ap.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_path("stdlib")),
        help="CPython Lib/ directory (default: this interpreter's)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="rebuild into a temp dir and compare sha256s with --out-dir",
    )
    args = ap.parse_args()

    if sys.version_info[:2] != (3, 11):
        print(f"warning: built from Python 3.11 sources; this is {sys.version.split()[0]}", file=sys.stderr)
    recorded = args.out_dir / CORPUS_DIR / "build_info.json"
    old = json.loads(recorded.read_text()) if recorded.exists() else None
    if old and old.get("python_version") != sys.version.split()[0]:
        print(
            f"warning: assets were built with Python {old['python_version']}, "
            f"this is {sys.version.split()[0]}: docstrings (and so the assets) may differ",
            file=sys.stderr,
        )

    if not args.check:
        build(args.out_dir, args.stdlib)
        return 0
    if old is None:
        print(f"--check: nothing recorded at {recorded}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        new = build(Path(tmp), args.stdlib)
    diff = {k for k in old["sha256"] if old["sha256"][k] != new["sha256"].get(k)}
    for k in sorted(diff):
        print(f"--check: {k} differs", file=sys.stderr)
    return 1 if diff else 0
