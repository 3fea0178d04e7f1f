"""Key layout of Gefen state in a DCP checkpoint (format ``gefen-titan/1``).

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``). ``fqn``
is a parameter's canonical name, ``opt`` the first parameter name of the Gefen
optimizer that owns it (unique across pipeline stages), ``r`` a source rank's
coordinate on the shard dim (replicas of HSDP share it, so DCP writes their
identical copies once).

==============================  ===========================================  ==================
key                             value                                        written by
==============================  ===========================================  ==================
``gefen/format``                str (json) {"format", "version"}             every rank (same)
``gefen/optimizer/{opt}``       str (json): nshards, and per parameter in    every rank of the
                                order: fqn, global shape, group hyper-       optimizer (same)
                                parameters
``gefen/codes/{fqn}``           uint8, the parameter's global shape and      DTensor: each its
                                placements                                   shard
``gefen/records/{opt}/{r}``     int64 [1 + P, 7]: row 0 = global step, P;    rank r
                                row 1 + i = parameter i's start, length,
                                period, step, vmean_step, first block,
                                number of blocks
``gefen/blocks/{opt}/{r}``      fp32 [blocks, 2]: magnitude, vmean, all      rank r
                                parameters of the optimizer back to back
``gefen/codebook/{opt}/{r}``    fp32 [256], sorted, ends -1 and +1           rank r
==============================  ===========================================  ==================

Codes are the only per-element data (1 byte each); everything else is per
block or per rank. The per-rank records are packed per optimizer because DCP
stores every entry with ~1.5 KB of framing: one entry per parameter and rank
would cost more than the blocks themselves. DCP reshards the codes
element-wise; a new rank reads the records of every old rank and the blocks
of the old ranks it overlaps. ``period`` 0 marks a rank that holds no state
for that parameter yet (never stepped, or an empty shard).
"""

from __future__ import annotations

FORMAT = "gefen-titan"
VERSION = 1
PREFIX = "gefen/"

RECORD_FIELDS = ("start", "length", "period", "step", "vmean_step", "block0", "nblocks")


def format_key() -> str:
    return f"{PREFIX}format"


def optimizer_key(opt: str) -> str:
    return f"{PREFIX}optimizer/{opt}"


def codes_key(fqn: str) -> str:
    return f"{PREFIX}codes/{fqn}"


def records_key(opt: str, label: int) -> str:
    return f"{PREFIX}records/{opt}/{label}"


def blocks_key(opt: str, label: int) -> str:
    return f"{PREFIX}blocks/{opt}/{label}"


def codebook_key(opt: str, label: int) -> str:
    return f"{PREFIX}codebook/{opt}/{label}"
