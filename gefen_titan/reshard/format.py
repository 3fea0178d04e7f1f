"""Key layout of Gefen state in a DCP checkpoint (format ``gefen-titan/1``).

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``). ``fqn``
is a parameter's canonical name, ``opt`` the first parameter name of the Gefen
optimizer that owns it (unique across pipeline stages), ``r`` a source rank's
coordinate on the shard dim (replicas of HSDP share it, so DCP writes their
identical copies once).

=================================  ======================================  =====================
key                                value                                   written by
=================================  ======================================  =====================
``gefen/format``                   str (json) {"format", "version"}        every rank (same)
``gefen/param/{fqn}``              str (json) shape, optimizer, nshards,   every rank holding it
                                   group hyperparameters
``gefen/codes/{fqn}``              uint8, the parameter's global shape      DTensor: each its shard
                                   and placements
``gefen/layout/{fqn}/{r}``         int64 [5]: start, length, period,       rank r
                                   step, vmean_step
``gefen/blocks/{fqn}/{r}``         fp32 [length/period, 2]: magnitude,     rank r
                                   vmean
``gefen/codebook/{opt}/{r}``       fp32 [256], sorted, ends -1 and +1      rank r
``gefen/global_step/{opt}/{r}``    int64 [1]                               rank r
=================================  ======================================  =====================

Codes are the only per-element data (1 byte each); everything else is per
block or per rank. DCP reshards the codes element-wise; the per-rank records
are read by whichever new ranks overlap them. ``period`` 0 marks a rank that
holds no state for that parameter yet (never stepped, or an empty shard).
"""

from __future__ import annotations

FORMAT = "gefen-titan"
VERSION = 1
PREFIX = "gefen/"

LAYOUT_FIELDS = ("start", "length", "period", "step", "vmean_step")


def format_key() -> str:
    return f"{PREFIX}format"


def param_key(fqn: str) -> str:
    return f"{PREFIX}param/{fqn}"


def codes_key(fqn: str) -> str:
    return f"{PREFIX}codes/{fqn}"


def layout_key(fqn: str, label: int) -> str:
    return f"{PREFIX}layout/{fqn}/{label}"


def blocks_key(fqn: str, label: int) -> str:
    return f"{PREFIX}blocks/{fqn}/{label}"


def codebook_key(opt: str, label: int) -> str:
    return f"{PREFIX}codebook/{opt}/{label}"


def global_step_key(opt: str, label: int) -> str:
    return f"{PREFIX}global_step/{opt}/{label}"
