"""The torch a user installs is one the patches accept, and the refusal says how to get one.

``gefen_titan.patches.check_versions`` accepts the torch releases of
``SUPPORTED_TORCH`` (each verified: patches/README.md "Torch versions");
pyproject's ``torch`` dependency is what pip installs. Were they to differ, a
``pip install`` without a torch pin could resolve a torch the patches refuse
at start-up (issue 47: pyproject said ``torch>=2.13``, the index served 2.15.0,
the patches took 2.13 only). Here the two are compared over every release
version they could disagree on (pre-releases aside: pip takes none without
``--pre``), and the refusal's pip command is checked to install an accepted one.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import gefen_titan.patches as P
from gefen_titan.errors import UserError

ROOT = Path(__file__).resolve().parents[2]

# Releases the range and the check could disagree on: every minor of torch
# 1.x-3.x, a first and a later patch release, plain and as local builds.
CANDIDATES = [f"{a}.{b}.{c}{local}" for a in (1, 2, 3) for b in range(31) for c in (0, 1)
              for local in ("", "+cpu", "+cu130")]


def pyproject_torch() -> Requirement:
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    (torch,) = [d for d in deps if d.name == "torch"]
    return torch


def range_mismatches(spec: SpecifierSet, supported: tuple[tuple[int, int], ...]) -> list[str]:
    """The candidate versions that pip's range and the patches' check treat differently."""
    return [v for v in CANDIDATES if spec.contains(Version(v)) != (P._major_minor(v) in supported)]


def pip_command(message: str) -> list[Requirement]:
    (command,) = re.findall(r"`pip install ([^`]+)`", message)
    return [Requirement(r) for r in re.findall(r"'([^']+)'", command)]


def test_pyproject_range_is_exactly_the_accepted_set():
    torch = pyproject_torch()
    assert not range_mismatches(torch.specifier, P.SUPPORTED_TORCH)
    assert torch.specifier == Requirement(P.TORCH_REQUIREMENT).specifier, (str(torch), P.TORCH_REQUIREMENT)
    assert not torch.marker and not torch.extras


@pytest.mark.parametrize("supported", [((2, 13),), ((2, 14),), ((2, 13), (2, 14), (2, 15)),
                                       ((2, 12), (2, 13), (2, 14))])
def test_a_version_accepted_on_one_side_only_is_caught(supported):
    """The comparison above fails when the patches gain or lose a release and
    pyproject does not, and the other way round (``>=2.13`` is issue 47's)."""
    assert range_mismatches(pyproject_torch().specifier, supported)
    assert range_mismatches(Requirement(P._requirement(supported)).specifier, P.SUPPORTED_TORCH)
    for stale in (">=2.13", ">=2.13,<2.14", ">=2.12,<2.15", "==2.13.*"):
        assert range_mismatches(SpecifierSet(stale), P.SUPPORTED_TORCH), stale


def test_requirement_is_one_range_of_consecutive_minors():
    assert P._requirement(((2, 13), (2, 14))) == "torch>=2.13,<2.15"
    assert P._requirement(((2, 13),)) == "torch>=2.13,<2.14"
    for gap in (((2, 13), (2, 15)), ((2, 14), (2, 13)), ((2, 14), (3, 0))):
        with pytest.raises(ValueError, match="consecutive"):
            P._requirement(gap)


@pytest.mark.parametrize("version", ["2.15.0", "2.15.0+cu130", "2.12.1", "3.0.0"])
def test_refusal_names_the_pip_command_that_installs_an_accepted_torch(monkeypatch, version):
    monkeypatch.setattr(P, "_torch_version", lambda: version)
    with pytest.raises(UserError) as e:  # the entry point prints it as a block, no traceback
        P.check_versions()
    assert isinstance(e.value, RuntimeError)
    msg = str(e.value)
    assert f"torch {version} (expected 2.13.x or 2.14.x)" in msg, msg
    assert "`pip install 'torch>=2.13,<2.15'`" in msg, msg
    (req,) = pip_command(msg)
    assert req.name == "torch" and req.specifier == pyproject_torch().specifier
    assert not req.specifier.contains(version) and req.specifier.contains("2.14.1")


def test_refusal_follows_the_accepted_set(monkeypatch):
    """Taking a release out of SUPPORTED_TORCH refuses it, with the narrower command."""
    monkeypatch.setattr(P, "_torch_version", lambda: "2.14.1+cu130")
    P.check_versions()
    monkeypatch.setattr(P, "SUPPORTED_TORCH", ((2, 13),))
    with pytest.raises(RuntimeError, match=re.escape("`pip install 'torch>=2.13,<2.14'`")):
        P.check_versions()


def test_refusal_of_both_names_both_pins(monkeypatch):
    monkeypatch.setattr(P, "_torch_version", lambda: "2.15.0")
    monkeypatch.setattr(P, "_torchtitan_version", lambda: "0.4.0")
    with pytest.raises(RuntimeError) as e:
        P.check_versions()
    assert [str(r) for r in pip_command(str(e.value))] == ["torchtitan==0.3.0", "torch<2.15,>=2.13"]


def test_install_lines_and_docs_name_the_accepted_torch():
    """README's GPU install line names the range; CI's CPU pin is inside it;
    patches/README.md has a verification row for each accepted release."""
    readme = (ROOT / "README.md").read_text()
    assert f"pip install '{P.TORCH_REQUIREMENT}'" in readme
    (ci_pin,) = re.findall(r"torch==([0-9][0-9.]*)", (ROOT / ".ci" / "run").read_text())
    assert pyproject_torch().specifier.contains(ci_pin) and P._major_minor(ci_pin) in P.SUPPORTED_TORCH
    doc = (ROOT / "patches" / "README.md").read_text()
    section = doc.split("## Torch versions", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| (\d+)\.(\d+)\.\d+ \|", section, flags=re.M))
    assert {(int(a), int(b)) for a, b in rows} == set(P.SUPPORTED_TORCH), rows
