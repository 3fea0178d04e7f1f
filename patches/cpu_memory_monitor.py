"""cpu_memory_monitor: give torchtitan's metrics a memory monitor that works on CPU.

What it fixes
    ``torchtitan.components.metrics.DeviceMemoryMonitor`` calls the CUDA-style
    device-module API (``get_device_name``, ``get_device_properties(...)
    .total_memory``, ``memory_stats``, ``reset_peak_memory_stats``,
    ``empty_cache``). ``torch.cpu`` has none of these, so once the device type is
    "cpu" (see ``cpu_device``) building ``MetricsProcessor`` in
    ``Trainer.__init__`` fails with::

        AttributeError: module 'torch.cpu' has no attribute 'get_device_name'

What it does
    Replaces ``torchtitan.components.metrics.build_device_memory_monitor`` with a
    version that, when torchtitan's device type is "cpu", returns a
    ``DeviceMemoryMonitor`` subclass backed by the process's resident set size
    (``VmHWM``/``VmRSS`` from ``/proc/self/status``, falling back to
    ``resource.getrusage``) against the machine's physical memory. "active" and
    "reserved" both report peak RSS; retries/OOMs report 0. Peak resets use
    ``/proc/self/clear_refs`` where permitted (otherwise the peak is since
    process start). ``device_name`` is "CPU", so torchtitan's MFU uses its A100
    fallback peak FLOPS: MFU/TFLOPS numbers are meaningless on CPU.

Scope
    CPU-only: on any other device type the original builder is called unchanged.

Upstream status
    Unfixed upstream as of torchtitan 0.3.0.
"""

from __future__ import annotations

import functools
import os

from ._util import is_marked, mark, require_attr, require_params

NAME = "cpu_memory_monitor"

_GIB = 1024**3


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_rss_bytes() -> int:
    kib = _read_status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kib) * 1024


def _total_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _make_cpu_monitor_class(base: type) -> type:
    class CpuMemoryMonitor(base):  # type: ignore[misc, valid-type]
        """Peak-RSS based stand-in for torchtitan's DeviceMemoryMonitor."""

        def __init__(self, device: str = "cpu"):
            import torch

            self.device = torch.device("cpu")
            self.device_name = "CPU"
            self.device_index = 0
            self.device_capacity = _total_memory_bytes() or 1
            self.device_capacity_gib = self._to_gib(self.device_capacity)
            self.reset_peak_stats()

        def get_peak_stats(self):
            from torchtitan.components.metrics import DeviceMemStats

            peak = _peak_rss_bytes()
            gib, pct = self._to_gib(peak), self._to_pct(peak)
            return DeviceMemStats(gib, pct, gib, pct, 0, 0)

        def reset_peak_stats(self):
            # "5" resets VmHWM to the current RSS (Linux >= 4.0); best effort.
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    return CpuMemoryMonitor


def apply() -> bool:
    import torchtitan.components.metrics as metrics

    original = require_attr(metrics, "build_device_memory_monitor")
    base = require_attr(metrics, "DeviceMemoryMonitor")
    require_attr(metrics, "DeviceMemStats")
    require_params(original, [], "torchtitan.components.metrics.build_device_memory_monitor")
    for m in ("_to_gib", "_to_pct", "get_peak_stats", "reset_peak_stats"):
        require_attr(base, m)
    if is_marked(original):
        return True

    cpu_monitor_cls = _make_cpu_monitor_class(base)

    @functools.wraps(original)
    def build_device_memory_monitor():
        import torchtitan.tools.utils as tu

        if tu.device_type != "cpu":
            return original()
        monitor = cpu_monitor_cls()
        metrics.logger.info(
            f"CPU capacity: {monitor.device_name} with "
            f"{monitor.device_capacity_gib:.2f}GiB memory (peak RSS is reported)"
        )
        return monitor

    build_device_memory_monitor.CpuMemoryMonitor = cpu_monitor_cls  # type: ignore[attr-defined]
    metrics.build_device_memory_monitor = mark(build_device_memory_monitor, original)
    return True


def is_applied() -> bool:
    import torchtitan.components.metrics as metrics

    return is_marked(metrics.build_device_memory_monitor)
