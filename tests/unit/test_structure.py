"""The package keeps the shape docs/architecture.md describes.

Import layering and cycles are import-linter's (``lint-imports``, contracts in
pyproject.toml, run by CI); these are the rules it does not check: modules
small enough to have one job, few modules at the top level, and no module
reaching for another module's underscore names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gefen_titan"
MAX_LINES = 500  # "small modules named for what they do": split a module that outgrows it
MAX_TOP_LEVEL = 8  # everything else lives in a subpackage named for its concern


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_small():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def _private_imports(source: str, where: str) -> list[str]:
    """``from gefen_titan.x import _y`` and relative imports in ``source``."""
    offences = []
    for node in ast.walk(ast.parse(source)):
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
