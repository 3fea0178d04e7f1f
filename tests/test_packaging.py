"""Every subpackage of gefen_titan ships in the wheel.

``pip install .`` builds the wheel from pyproject's explicit package list; a
subpackage missing there is missing for every user, while an editable
install (as the tests run) would still find it.
"""

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gefen_titan").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found <= listed, f"missing from pyproject [tool.setuptools] packages: {sorted(found - listed)}"
    assert config["package-dir"]["gefen_titan.patches"] == "patches"
