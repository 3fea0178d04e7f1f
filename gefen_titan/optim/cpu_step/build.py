"""Building and loading the kernel: compiled on first use, cached per machine.

``kernel.cpp`` ships as source in the package. The first process that needs
it compiles it with the system's C++ compiler against the installed torch's
own headers and libraries (about 5-10 s), into a cache folder keyed by the
source, the flags, the compiler and torch; every later process loads the
cached library (milliseconds). Several ranks starting at once take a file
lock, so one compiles and the others wait for it.

Why this and not the other two ways (docs/cpu_step.md):

* built at install would need torch inside pip's isolated build environment
  (pip could then fetch another, multi-GB CUDA build of torch) or
  ``--no-build-isolation`` in the README's install command, and it would tie
  the wheel to the torch it was built against (torch's C++ ABI changes between
  releases, and the package takes any torch >= 2.13);
* shipped prebuilt would need one binary per platform and torch release.

What it needs at run time: a C++ compiler (``$CXX``, else ``g++`` or ``c++``;
GCC 10+ or Clang 13+, C++20), the torch headers that torch's wheels ship,
and a CPU for which torch runs its AVX2 or AVX-512 kernels (the kernel is
written with AVX2 intrinsics; on AVX-512 machines it follows the summation
order of torch's 16-wide kernels). Without them the step runs gefen-x's own
path, and ``load()`` says why (the caller logs it once). The cache is
``$GEFEN_TITAN_CPU_STEP_CACHE``, else ``$XDG_CACHE_HOME/gefen_titan/cpu_step``
(``~/.cache/...``).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ABI_VERSION", "Library", "Unavailable", "cache_dir", "load", "source_path", "sum_width"]

ABI_VERSION = 1  # kernel.cpp's gt_abi_version(): the layout of the argument structs
# -ffp-contract=off: no multiply-add may fuse unless the source says so (torch's roundings are the spec).
_FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",
          "-fno-math-errno", "-w"]
# torch's vector width for fp32 (its sum's order) by the CPU capability it dispatches to.
_WIDTHS = {"AVX2": 8, "AVX512": 16}


@dataclass(frozen=True)
class Library:
    lib: ctypes.CDLL
    path: Path
    sum_width: int
    built_s: float  # seconds compiling in this process (0.0: found in the cache)
    loaded_s: float  # seconds to load it (and wait for another process's build)


@dataclass(frozen=True)
class Unavailable:
    reason: str


def source_path() -> Path:
    return Path(__file__).with_name("kernel.cpp")


def cache_dir() -> Path:
    root = os.environ.get("GEFEN_TITAN_CPU_STEP_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gefen_titan" / "cpu_step"


def sum_width() -> int | None:
    """torch's fp32 vector width on this machine, None if the kernel cannot follow it."""
    return _WIDTHS.get(torch.backends.cpu.get_cpu_capability())


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256()
    for part in (source_path().read_bytes(), " ".join(_FLAGS).encode(), version.encode(), torch.__version__.encode(),
                 str(_torch_dirs()[0]).encode(), str(ABI_VERSION).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(cxx: str, out: Path) -> str | None:
    """Compile into ``out`` (atomically); the compiler's first error line on failure."""
    include, lib = _torch_dirs()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include}", str(source_path()), "-o", tmp, f"-L{lib}", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{lib}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return f"{cxx} failed to run: {e}"
    if done.returncode != 0:
        os.unlink(tmp)
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if "error" in ln] or ["(no message)"]
        return f"{cxx} could not compile {source_path().name}: {lines[0].strip()}"
    os.replace(tmp, out)
    return None


_lock = threading.Lock()
_loaded: Library | Unavailable | None = None


def load() -> Library | Unavailable:
    """The kernel library (built if this machine has none cached), or why it cannot run here. Once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except OSError as e:  # an unwritable cache, a library that does not load
                _loaded = Unavailable(f"the kernel could not be built or loaded: {e}")
        return _loaded


def _load() -> Library | Unavailable:
    width = sum_width()
    if width is None:
        return Unavailable(f"torch runs its {torch.backends.cpu.get_cpu_capability()} CPU kernels here, and the "
                           "kernel needs AVX2 or AVX-512 ones (their roundings and summation order are what it "
                           "reproduces)")
    cxx = _compiler()
    if cxx is None:
        return Unavailable("no C++ compiler found ($CXX, g++ or c++ on PATH); install g++ to build the kernel")
    start = time.perf_counter()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gefen_cpu_step-{_key(cxx)}.so"
    built = 0.0
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles, the others wait and load its library
        if not path.exists():
            t0 = time.perf_counter()
            error = _compile(cxx, path)
            if error is not None:
                return Unavailable(error)
            built = time.perf_counter() - t0
    lib = ctypes.CDLL(str(path))
    if lib.gt_abi_version() != ABI_VERSION:
        return Unavailable(f"{path} has argument layout {lib.gt_abi_version()}, expected {ABI_VERSION}")
    for name in ("gt_gefen_moments", "gt_gefen_apply", "gt_muon_momentum"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    return Library(lib=lib, path=path, sum_width=width, built_s=built,
                   loaded_s=time.perf_counter() - start - built)
