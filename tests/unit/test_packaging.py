"""Every module and asset of gefen_titan ships in the wheel.

``pip install .`` builds the wheel from pyproject's explicit package list; a
subpackage missing there is missing for every user, while an editable
install (as the tests run) would still find it.
"""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gefen_titan").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found <= listed, f"missing from pyproject [tool.setuptools] packages: {sorted(found - listed)}"
    assert config["package-dir"]["gefen_titan.patches"] == "patches"


def test_the_wheel_holds_every_module_and_asset(tmp_path):
    """Build the wheel as ``pip install .`` does (from a copy of the tracked
    files, so the checkout gets no build folders) and compare its files with
    the source tree: every module of gefen_titan/ and patches/ and every
    asset must be in it."""
    import shutil
    import subprocess
    import zipfile

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True,
                             timeout=60)
    src = tmp_path / "src"
    for rel in filter(None, tracked.stdout.split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("gefen_titan-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    def wanted(folder: str, package: str, pattern: str):
        return {f"{package}/{p.relative_to(src / folder).as_posix()}" for p in (src / folder).rglob(pattern)
                if p.is_file() and "__pycache__" not in p.parts}

    modules = wanted("gefen_titan", "gefen_titan", "*.py") | wanted("patches", "gefen_titan/patches", "*.py")
    assets = wanted("gefen_titan/assets", "gefen_titan/assets", "*")
    assets |= wanted("gefen_titan", "gefen_titan", "*.cpp")  # the CPU step's kernel, compiled on first use
    assert modules and assets
    assert not modules - shipped, f"modules missing from the wheel: {sorted(modules - shipped)}"
    assert not assets - shipped, f"assets missing from the wheel: {sorted(assets - shipped)}"
    entry_points = next(n for n in shipped if n.endswith(".dist-info/entry_points.txt"))
    assert "gefen-titan-train = gefen_titan.train:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
