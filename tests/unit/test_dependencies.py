"""What the package imports is what it declares, and nothing of the checkout's.

* Every third-party module that ``gefen_titan/`` or ``patches/`` imports
  (top-level name, read with ``ast``; the standard library is
  ``sys.stdlib_module_names``) belongs to a distribution listed in
  pyproject's ``[project] dependencies``: an undeclared one works in the
  development environment, which happens to have it, and fails for a user.
  An import inside ``try: ... except ImportError`` is optional and exempt.
* The package imports none of ``benchmarks``, ``tools``, ``tests``: they are folders
  of the checkout, not of the wheel.
* The validation derives no path from its own file: it runs from the
  installed wheel, where no checkout surrounds it.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "gefen_titan", ROOT / "patches")
FIRST_PARTY = {"gefen_titan"}
CHECKOUT_ONLY = {"benchmarks", "tests", "tools"}

# Import name -> distribution name, where they differ.
IMPORT_TO_DIST = {"gefen": "gefen-x", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    """[project] dependencies, and the optional extras the package imports from (torchft: ``[ft]``);
    the ``test`` extra is the checkout's, not the package's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    deps = project["dependencies"] + [d for name, ds in extras.items() if name != "test" for d in ds]
    return {canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", d.strip()).group(0)) for d in deps}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def imported_modules(files: list[Path]) -> dict[str, set[str]]:
    """Top-level name of every absolute import -> the files importing it,
    less the optional imports (in a ``try`` whose handler catches ImportError)."""
    out: dict[str, set[str]] = {}
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        guarded = [t for t in ast.walk(tree) if isinstance(t, ast.Try) and any(map(_catches_import_error, t.handlers))]
        optional = {id(n) for t in guarded for stmt in t.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                out.setdefault(name.split(".")[0], set()).add(str(f))
    return out


def undeclared(imports: dict[str, set[str]], declared: set[str]) -> dict[str, set[str]]:
    """The third-party imports whose distribution is not declared."""
    return {m: files for m, files in imports.items()
            if m not in sys.stdlib_module_names and m not in FIRST_PARTY | CHECKOUT_ONLY
            and canonical(IMPORT_TO_DIST.get(m, m)) not in declared}


def package_files() -> list[Path]:
    return [p for root in SOURCES for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]


def test_every_third_party_import_is_declared():
    imports = imported_modules(package_files())
    assert {"torch", "torchtitan", "gefen", "numpy", "numba", "fsspec", "matplotlib"} <= set(imports)  # not vacuous
    missing = undeclared(imports, declared_distributions())
    assert not missing, ("imported but not in pyproject [project] dependencies (add it, or map its import name "
                         f"in IMPORT_TO_DIST): {missing}")


def test_the_check_catches_an_undeclared_and_spares_an_optional_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nimport yaml\nfrom gefen.quantization import exact_dp\n"
                 "try:\n    import tqdm\nexcept ImportError:\n    tqdm = None\n")
    imports = imported_modules([f])
    assert set(imports) == {"os", "yaml", "gefen"}  # tqdm is optional
    assert set(undeclared(imports, {"gefen-x"})) == {"yaml"}
    assert undeclared(imports, {"gefen-x", "pyyaml"}) == {}


def test_the_package_imports_nothing_of_the_checkout():
    imports = imported_modules(package_files())
    assert not {m: imports[m] for m in CHECKOUT_ONLY if m in imports}


def test_the_validation_derives_no_path_from_its_own_file():
    for f in sorted((ROOT / "gefen_titan" / "validation").glob("*.py")):
        names = {n.id for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Name)}
        assert "__file__" not in names, f"{f.name} derives a path from __file__"
