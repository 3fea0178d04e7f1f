"""What a run computes, as a key: the reference cache (``--reference-cache``) reuses a run of equal key.

A key holds the merged recipe tables and flags (the config), and also the
code that runs them: a digest of the installed ``gefen_titan`` package's
files (its modules, the patches it applies and its assets) and the versions
of the libraries whose arithmetic training runs (torch, torchtitan, gefen-x).
A reference trained before an edit of the optimizer, or under another torch,
is another run, and is never handed to a validator as if it were this one.

The layout is part of the key as the run's effective degrees (every
``--parallelism.*_degree``, the shard degree filled in), wherever they were
set (recipe table, base config or flag): the same processes at another
layout are another run (``2`` and ``2@tp2``), and one layout however spelled
is one run (``llama_gefen_tp2.toml`` at 2 and ``llama_gefen.toml`` at
``2@tp2``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path

import gefen_titan
from gefen_titan import patches
from gefen_titan.validation.hooks import DUMP_VERSION
from gefen_titan.validation.launchers import torch_cpu_kernels
from gefen_titan.validation.layouts import DEGREES, degree_keys, strip_degree_flags
from gefen_titan.validation.recipes import config_of, merged_tables

__all__ = ["LIBRARIES", "code_digest", "installed_code_digest", "library_versions", "package_roots", "run_identity",
           "run_layout"]

# The distributions whose code a training run executes, besides gefen_titan.
LIBRARIES = ("torch", "torchtitan", "gefen-x")


def package_roots() -> list[Path]:
    """The folders of the installed package: ``gefen_titan`` and its
    ``patches`` (a separate folder in a checkout, ``patches/``)."""
    roots = {Path(p).resolve() for p in [*gefen_titan.__path__, *patches.__path__]}
    # In a wheel patches/ lies inside gefen_titan/: hash it once.
    return sorted(r for r in roots if not any(o in r.parents for o in roots))


def code_digest(roots: list[Path]) -> str:
    """sha256 over every file under ``roots`` (relative path and bytes),
    compiled caches left out: it changes with any edit of the code."""
    h = hashlib.sha256()
    for root in roots:
        files = sorted(p for p in root.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for path in files:
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


@functools.cache
def installed_code_digest() -> str:
    """``code_digest`` of the package this process imported (computed once)."""
    return code_digest(package_roots())


def library_versions() -> dict[str, str]:
    """The installed version of each of ``LIBRARIES`` ("?" where absent)."""
    out = {}
    for dist in LIBRARIES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "?"
    return out


def run_layout(recipe: str, nproc: int, overrides: list[str]) -> dict[str, int]:
    """The degrees a run of ``recipe`` with ``overrides`` at ``nproc`` processes
    trains with (``layouts.DEGREES``' names; the shard degree filled in as
    torchtitan fills -1)."""
    par = config_of(recipe, overrides).parallelism
    out = {name: int(getattr(par, key)) for name, key in DEGREES.items()}
    if out["fsdp"] < 0:
        others = out["pp"] * out["rep"] * out["cp"] * out["tp"]
        out["fsdp"] = max(1, nproc // others)
    return out


def run_identity(recipe: str, nproc: int, overrides: list[str], *, code: str | None = None,
                 versions: dict[str, str] | None = None, cpu_kernels: str | None = None) -> str:
    """What a run computes: the merged recipe tables plus the recipe flags of
    the overrides, with the fields that do not change training (description,
    dump folder) left out, the other (torchtitan) flags as given, the layout
    (``run_layout``: the effective degrees, which replace the degree keys
    and flags), the version of the state dumps it holds, the code digest
    (``code``, default: the installed package's), the library versions
    (``versions``, default: the installed ones) and torch's CPU kernels the
    ranks run (``cpu_kernels``, as torch names them: ``AVX2``, ``AVX512``;
    default: this process's). The kernels round differently, so a run under
    one is not another's; a pin equal to the host's own kernels is the same
    run as no pin.

    Two recipes that resolve to the same tables (``llama_gefen.toml`` at 2
    ranks and ``llama_gefen_dp2.toml``) are the same run; so are two that
    reach the same layout (``llama_gefen_tp2.toml`` at 2 ranks and
    ``llama_gefen.toml`` at ``2@tp2``).
    """
    data, flags = merged_tables(recipe, overrides)
    job = data.get("job", {})
    for key in ("description", "dump_folder", "extends"):
        job.pop(key, None)
    par = data.setdefault("parallelism", {})
    for key in degree_keys():
        par.pop(key, None)
    flags, _ = strip_degree_flags(flags)
    blob = json.dumps({"nproc": nproc, "layout": run_layout(recipe, nproc, overrides),
                       "tables": data, "flags": flags, "dumps": DUMP_VERSION,
                       "code": installed_code_digest() if code is None else code,
                       "versions": library_versions() if versions is None else versions,
                       "cpu_kernels": cpu_kernels or torch_cpu_kernels(None)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
