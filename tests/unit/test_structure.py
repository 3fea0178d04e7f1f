"""The package keeps the shape docs/architecture.md describes.

Import layering and cycles are import-linter's (``lint-imports``, contracts in
pyproject.toml, run by CI); these are the rules it does not check: modules
small enough to have one job, few modules at the top level, and no module
reaching for another module's underscore names.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gefen_titan"
MAX_LINES = 400  # "small modules named for what they do": split one that outgrows it (issue 39: 450; 51: 400)
MAX_TOP_LEVEL = 8  # everything else lives in a subpackage named for its concern


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@functools.cache
def _parsed(source: str) -> ast.Module:
    """One parse per module for every test here (the parses are most of their time)."""
    return ast.parse(source)


def test_every_module_is_small():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def _private_imports(source: str, where: str) -> list[str]:
    """``from gefen_titan.x import _y`` and relative imports in ``source``."""
    offences = []
    for node in ast.walk(_parsed(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # the package uses absolute imports only
            offences.append(f"{where}:{node.lineno} relative import")
        elif (node.module or "").startswith("gefen_titan"):
            offences += [f"{where}:{node.lineno} {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return offences


def test_no_module_imports_another_modules_private_names():
    offences = [o for p in _modules() for o in _private_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert not offences, offences


def test_the_private_import_check_catches_what_it_is_for():
    bad = "from gefen_titan.optim.blocking import _all_gather, row_unit\nfrom . import x\nimport os\n"
    assert _private_imports(bad, "m") == ["m:1 gefen_titan.optim.blocking._all_gather", "m:2 relative import"]


# What starts ranks. Only tests/helpers/processes may call these: its
# launchers kill every rank when the wait ends early (a timeout, an
# interrupt); a test module's own launcher would leave them behind.
RANK_LAUNCHERS = ("start_processes", "mp.spawn", "multiprocessing.Process", "torch.distributed.run")


def _launches_ranks(source: str) -> list[str]:
    return [name for name in RANK_LAUNCHERS if name in source]


def test_only_the_process_helpers_start_ranks():
    allowed = {ROOT / "tests" / "helpers" / "processes.py", Path(__file__).resolve()}
    own = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "tests").rglob("*.py"))
           if p not in allowed and (found := _launches_ranks(p.read_text()))}
    assert not own, f"test files with their own rank launcher (use tests/helpers/processes): {own}"


def test_the_launcher_check_catches_what_it_is_for():
    assert _launches_ranks("mp.start_processes(fn, args=(), nprocs=2, join=True)") == ["start_processes"]
    assert _launches_ranks('cmd = [sys.executable, "-m", "torch.distributed.run"]') == ["torch.distributed.run"]
    assert _launches_ranks("processes.spawn(fn, (), 2, timeout=60)") == []


# ------------------------------------------------------------------ optimizer kinds
# A kind's knowledge lives in its own files (its folder under optim/kinds/, with its key rows, records and
# checkpoint description; its step and gefen-x accessors) and reaches everything else through its registry
# entry (registered by optim/kinds/__init__.py, which may name every kind) and its checkpoint description
# (checkpoint/format/kinds.py, which registers its key rows with checkpoint/format/schema.py):
# a module outside a kind's files that names it is a place a new kind would have to be added by hand.
# Names are code, not prose: identifiers and string constants (messages included), not docstrings or
# comments, which may speak of the kinds.
REGISTRY = "gefen_titan/optim/registry.py"
KIND_FILES = {
    "GefenMuon": (
        "gefen_titan/optim/muon/",  # its sharded step (step, bucket, stats, schedule, exchange, ...)
        "gefen_titan/optim/gefenx/muon.py",  # its accessors of gefen-x's private state
        "gefen_titan/optim/kinds/gefen_muon/",  # its entry, options, key rows, records, description, state
    ),
    "Gefen": (
        "gefen_titan/optim/gefenx/gefen.py",  # its gefen_* accessors of gefen-x's private state
        "gefen_titan/optim/kinds/gefen/",  # its entry, options, key rows, records, description, state, validation
        "gefen_titan/optim/quant/",  # its dequantize / re-block / requantize arithmetic
        "gefen_titan/ckpt_tools/convert.py",  # Gefen <-> AdamW: its arithmetic is Gefen's
        "gefen_titan/ckpt_tools/convert_to_gefen.py",  # its AdamW -> Gefen direction
    ),
    # A third kind laid out as a built-in one, in the tests (tests/unit/test_load_path.py registers it):
    # no package module may name it, so adding it took no package edit.
    "Variant": ("tests/kinds/variant/",),
}
# Shared by both kinds by what they are, so owned by both.
BOTH = (
    REGISTRY,
    "gefen_titan/optim/kinds/__init__.py",  # register_builtins: the list of the built-in kinds
    "gefen_titan/optim/gefenx/__init__.py",  # the one importer of gefen-x: every kind's accessors
    "gefen_titan/optim/gefenx/routing.py",
    "gefen_titan/optim/cpu_step/",  # the CPU kernels: Gefen's step and GefenMuon's momentum
    "gefen_titan/optim/hybrid.py",  # GefenMuonHybrid: a composite of the two
)
# Modules that still name a kind outside its files, each with why (keep this short; issue 39).
NAMES_KIND_STILL = {
    "gefen_titan/optim/container.py": "the Config's default name (\"Gefen\") and the refusal of a Gefen "
                                      "subclass no entry owns (the kinds' tables are generated: config_tables)",
    "gefen_titan/ckpt_tools/cli.py": "the help of convert, whose conversion is Gefen <-> AdamW (ckpt_tools/convert.py)",
}
_KIND_NAMES = {
    "Variant": (re.compile(r"(?i)(?<![a-z])variant"), re.compile(r"(?i)\bvariant\b")),  # not "invariant"
    "GefenMuon": (re.compile(r"(?i)(?<!dist)muon"), re.compile(r"(?i)(?<!dist)muon")),  # not torchtitan's DistMuon
    # Gefen's accessors are gefen_* (gx.gefen_read, GEFEN_LIVE_BLOCK_FLOATS), its types Gefen*; not gefen_titan.
    "Gefen": (re.compile(r"^(is_gefen|new_gefen|build_gefen)$|^gefen_(?!titan|muon)|^GEFEN_|"
                         r"Gefen(Sharded|PerRank|Param|Optimizer\b|Options\b)"), re.compile(r"\bGefen\b")),
}


def _code_names(source: str) -> list[tuple[int, str, bool]]:
    """(line, identifier or string constant, whether an identifier) of the code, without docstrings."""
    tree = _parsed(source)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
        if isinstance(node, ast.ClassDef):  # attribute docstrings: a string statement after an assignment
            docs |= {id(b.value) for b in node.body[1:]
                     if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.append((line, node.id, True))
        elif isinstance(node, ast.Attribute):
            out.append((line, node.attr, True))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, node.name, True))
        elif isinstance(node, ast.alias):
            out += [(line, part, True) for part in (node.asname or node.name).split(".")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(line, part, True) for part in node.module.split(".")]
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            out.append((line, node.arg, True))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append((line, node.value, False))
    return out


def _names_kind(source: str | list[tuple[int, str, bool]], kind: str) -> list[str]:
    """Where ``source`` (or its ``_code_names``) names ``kind``."""
    ident, text = _KIND_NAMES[kind]
    names = _code_names(source) if isinstance(source, str) else source
    found = {(line, name[:40]) for line, name, is_id in names if (ident if is_id else text).search(name)}
    return [f"{line}: {name!r}" for line, name in sorted(found)]


def _owned(path: str, kind: str) -> bool:
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in KIND_FILES[kind] + BOTH)


def test_no_module_outside_a_kinds_files_names_it():
    offences = {}
    for p in _modules():
        rel = str(p.relative_to(ROOT))
        foreign = [kind for kind in KIND_FILES if not _owned(rel, kind)]
        if rel in NAMES_KIND_STILL or not foreign:
            continue
        names = _code_names(p.read_text())
        for kind in foreign:
            if found := _names_kind(names, kind):
                offences[f"{rel} names {kind}"] = found[:4]
    assert not offences, offences


def test_the_kind_name_check_catches_what_it_is_for():
    src = ('"""Gefen and GefenMuon in prose."""\n'
           'from gefen_titan.optim.checkpointing import GefenMuonShardedAdapter\n'
           'x = gx.is_gefen(o) or "GefenMuon state" or "Gefen state" or "DistMuon" or "gefen-titan"\n'
           'import gefen_titan.optim.kinds.gefen_muon\n'
           'y = gx.gefen_read(o, p) or gx.GEFEN_CONSTRUCTOR or gx.period(o, p)\n')
    assert _names_kind(src, "GefenMuon") == ["2: 'GefenMuonShardedAdapter'", "3: 'GefenMuon state'", "4: 'gefen_muon'"]
    assert _names_kind(src, "Gefen") == ["3: 'Gefen state'", "3: 'is_gefen'", "5: 'GEFEN_CONSTRUCTOR'",
                                         "5: 'gefen_read'"]
    variant = ('from tests.kinds.variant import entry as variant_entry\nspec = registry.get("Variant")\n'
               'ok = loader.dp_invariant or "a DP-invariant loader"\n')
    assert _names_kind(variant, "Variant") == ["1: 'variant'", "1: 'variant_entry'", "2: 'Variant'"]
    assert all(p in NAMES_KIND_STILL or (ROOT / p).exists() for p in NAMES_KIND_STILL)
