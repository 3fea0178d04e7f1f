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

Two builds of the one source (``ISAS``): ``"avx2"`` (AVX2, FMA and F16C
vector loops; every x86 CPU since 2013-2015, AVX-512 ones included) and
``"portable"`` (plain C++, no intrinsics: ARM hosts such as Grace, and x86
CPUs without AVX2). Both make the same roundings; which one a host gets is
``isa()``: the AVX2 build where the CPU has those instructions, else the
portable one; ``$GEFEN_TITAN_CPU_STEP_ISA`` forces one (``avx2`` or
``portable``; the tests force the portable build to check it). Where the
torch rounding facts the kernel follows are taken from is not this module:
``probe.py`` asks the installed torch, in every process.

What it needs at run time: a C++ compiler (``$CXX``, else ``g++`` or ``c++``;
GCC 10+ or Clang 13+, C++20) and the torch headers that torch's wheels ship.
Without them the step runs gefen-x's own path, and ``load()`` says why (the
caller logs it once). The cache is ``$GEFEN_TITAN_CPU_STEP_CACHE``, else
``$XDG_CACHE_HOME/gefen_titan/cpu_step`` (``~/.cache/...``).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ABI_VERSION", "ISAS", "ISA_ENV", "Built", "Library", "Unavailable", "cache_dir", "isa", "load",
           "source_path"]

ABI_VERSION = 3  # kernel.cpp's gt_abi_version(): the layout of the argument structs (3: GefenArgs.out)
# -ffp-contract=off: no multiply-add may fuse unless the source says so (torch's roundings are the spec).
_FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-w"]
# The builds and their own flags. 512-bit vector loops were measured no faster than the AVX2 ones on an
# AVX-512 host (docs/cpu_step.md, "AVX-512 hosts"), so AVX-512 CPUs take the AVX2 build.
ISAS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "portable": ["-DGT_PORTABLE"]}
ISA_ENV = "GEFEN_TITAN_CPU_STEP_ISA"
_AVX2_FLAGS = {"avx2", "fma", "f16c"}  # /proc/cpuinfo's names of what the avx2 build uses


@dataclass(frozen=True)
class Built:
    """The compiled library, loaded: not yet checked against torch (``cpu_step.kernel()`` does that)."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # a key of ISAS
    built_s: float  # seconds compiling in this process (0.0: found in the cache)
    loaded_s: float  # seconds to load it (and wait for another process's build)

    def follow(self, sum_width: int, sum_width_f64: int, fused: bool) -> Library:
        """This build, set to follow torch's roundings as ``probe.py`` found them."""
        return Library(lib=self.lib, path=self.path, isa=self.isa, built_s=self.built_s, loaded_s=self.loaded_s,
                       sum_width=sum_width, sum_width_f64=sum_width_f64, fused=fused)


@dataclass(frozen=True)
class Library(Built):
    """A build and the torch roundings it follows in this process: the lanes of torch's sum order for float
    and double rows, and whether torch's ``lerp`` and ``add_(alpha)`` are one fused multiply-add."""

    sum_width: int
    sum_width_f64: int
    fused: bool


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


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> str:
    """The build this host runs: ``$GEFEN_TITAN_CPU_STEP_ISA`` if set, else ``"avx2"`` on an x86-64 CPU with
    AVX2, FMA and F16C, else ``"portable"``. Raises ``ValueError`` for an unknown forced name."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {sorted(ISAS)}")
        return forced
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "avx2" if x86 and _AVX2_FLAGS <= _cpu_flags() else "portable"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _flags(which: str) -> list[str]:
    return [*_FLAGS, *ISAS[which]]


def _key(cxx: str, which: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256()
    for part in (source_path().read_bytes(), " ".join(_flags(which)).encode(), version.encode(),
                 torch.__version__.encode(),
                 str(_torch_dirs()[0]).encode(), str(ABI_VERSION).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(cxx: str, which: str, out: Path) -> str | None:
    """Compile into ``out`` (atomically); the compiler's first error line on failure."""
    include, lib = _torch_dirs()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_flags(which), f"-I{include}", str(source_path()), "-o", tmp, f"-L{lib}", "-ltorch_cpu", "-lc10",
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
_loaded: dict[str, Built | Unavailable] = {}


def load(which: str | None = None) -> Built | Unavailable:
    """The kernel library of build ``which`` (default: ``isa()``), built if this machine has none cached, or
    why it cannot run here. Once per process and build."""
    with _lock:
        try:
            which = which or isa()
        except ValueError as e:
            return Unavailable(str(e))
        if which not in _loaded:
            try:
                _loaded[which] = _load(which)
            except OSError as e:  # an unwritable cache, a library that does not load
                _loaded[which] = Unavailable(f"the kernel could not be built or loaded: {e}")
        return _loaded[which]


def _load(which: str) -> Built | Unavailable:
    cxx = _compiler()
    if cxx is None:
        return Unavailable("no C++ compiler found ($CXX, g++ or c++ on PATH); install g++ to build the kernel")
    start = time.perf_counter()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gefen_cpu_step-{which}-{_key(cxx, which)}.so"
    built = 0.0
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles, the others wait and load its library
        if not path.exists():
            t0 = time.perf_counter()
            error = _compile(cxx, which, path)
            if error is not None:
                return Unavailable(error)
            built = time.perf_counter() - t0
    lib = ctypes.CDLL(str(path))
    if lib.gt_abi_version() != ABI_VERSION:
        return Unavailable(f"{path} has argument layout {lib.gt_abi_version()}, expected {ABI_VERSION}")
    for name in ("gt_gefen_moments", "gt_gefen_apply", "gt_gefen_momentum", "gt_muon_momentum"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.gt_row_sumsq.restype = ctypes.c_int
    lib.gt_row_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                 ctypes.c_void_p]
    if bool(lib.gt_simd()) != (which != "portable"):
        return Unavailable(f"{path} is not the {which} build")
    return Built(lib=lib, path=path, isa=which, built_s=built, loaded_s=time.perf_counter() - start - built)
