"""Gefen's keys in the checkpoint format: its rows (``ROWS``), registered with its description, and the
functions that name and shape its entries.

Gefen's records are key kind ``gefen`` under the segment ``optimizer``, which
every version (v1 on) has written them under (``checkpoint.format.schema``:
a segment is on disk, a key kind is a name in code). v3 stores a stateful
parameter's codes and its per-block magnitude and ``vmean`` (packed as one
grid entry, ``pack_blocks``) raw, under keys no earlier version wrote
(``qcodes``, ``grid``); v2 stored them as three framed entries (``codes``,
``magnitude``, ``vmean``, the last two on the *block grid*: the shape with
the last dimension divided by the period). DCP's metadata holds one chunk
record per entry per rank and frames every stored item, so v3's one entry
fewer per parameter is a third less of both. v1 (per-rank blocking) writes
each source rank's table, blocks and codebook under ``/{r}`` keys.
"""

from __future__ import annotations

import torch

from gefen_titan.checkpoint.format.schema import V2, VERSION, FormatError, KeyRow, grid_shape

__all__ = ["ROWS", "V1_KINDS", "KEY_DOCS", "HYPER", "PARAM_TENSORS", "optimizer_key", "codebook_key", "codes_key",
           "qcodes_key", "magnitude_key", "vmean_key", "grid_key", "records_key", "blocks_key", "rank_codebook_key",
           "param_tensor_keys", "param_key_kinds", "param_tensor_specs", "pack_blocks", "unpack_blocks"]

# Group hyperparameters carried in the records and restored on load (torch
# optimizers restore theirs the same way; the LR scheduler then resets lr).
HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")

_ROW = {r.kind: r for r in (
    KeyRow("gefen", "gefen/optimizer/{opt}", small="str"),
    KeyRow("codebook", "gefen/codebook/{opt}", small="tensor"),  # v2, v3: the job's codebook
    KeyRow("codes", "gefen/codes/{fqn}"),  # v2 and v1
    KeyRow("qcodes", "gefen/qcodes/{fqn}", raw=True),  # v3: the codes
    KeyRow("magnitude", "gefen/magnitude/{fqn}"),  # v2
    KeyRow("vmean", "gefen/vmean/{fqn}"),  # v2
    KeyRow("grid", "gefen/grid/{fqn}", raw=True),  # v3: magnitude and vmean in one entry
    KeyRow("records", "gefen/records/{opt}/{r}", small="tensor"),  # v1: a source rank's table
    KeyRow("blocks", "gefen/blocks/{opt}/{r}"),  # v1: its blocks' magnitude and vmean
    KeyRow("rank_codebook", "gefen/codebook/{opt}/{r}", small="tensor"),  # v1: its codebook
)}
ROWS: tuple[KeyRow, ...] = tuple(_ROW.values())
V1_KINDS = frozenset({"records", "blocks", "rank_codebook", "codes"})

# A stateful agreed parameter's tensors per version, in the order the
# adapters and tools list them, and their key kinds (v3's codes have a key of their own, stored raw).
PARAM_TENSORS = {VERSION: ("codes", "grid"), V2: ("codes", "magnitude", "vmean")}
_TENSOR_KINDS = {VERSION: {"codes": "qcodes", "grid": "grid"},
                 V2: {"codes": "codes", "magnitude": "magnitude", "vmean": "vmean"}}


def optimizer_key(opt: str) -> str:
    """A Gefen optimizer's record (kind ``gefen``)."""
    return _ROW["gefen"].key(opt)


def codebook_key(opt: str) -> str:
    """v2/v3: the job's codebook, under each optimizer's id."""
    return _ROW["codebook"].key(opt)


def codes_key(fqn: str) -> str:
    """v2 and v1 (v3: ``qcodes_key``)."""
    return _ROW["codes"].key(fqn)


def qcodes_key(fqn: str) -> str:
    """v3: the codes, stored raw."""
    return _ROW["qcodes"].key(fqn)


def magnitude_key(fqn: str) -> str:
    """v2 only."""
    return _ROW["magnitude"].key(fqn)


def vmean_key(fqn: str) -> str:
    """v2 only."""
    return _ROW["vmean"].key(fqn)


def grid_key(fqn: str) -> str:
    """v3: magnitude and vmean in one entry (``pack_blocks``)."""
    return _ROW["grid"].key(fqn)


def records_key(opt: str, rank: int) -> str:
    return _ROW["records"].key(opt, rank)


def blocks_key(opt: str, rank: int) -> str:
    return _ROW["blocks"].key(opt, rank)


def rank_codebook_key(opt: str, rank: int) -> str:
    """v1: one codebook per optimizer per source rank."""
    return _ROW["rank_codebook"].key(opt, rank)


def param_tensor_keys(fqn: str, version: int = VERSION) -> dict[str, str]:
    """An agreed parameter's entries by ``PARAM_TENSORS[version]`` name."""
    return {name: _ROW[_TENSOR_KINDS[version][name]].key(fqn) for name in PARAM_TENSORS[version]}


def param_key_kinds(version: int) -> tuple[str, ...]:
    """The key kinds of an agreed parameter's entries in ``version`` (v3: qcodes, grid)."""
    return tuple(_TENSOR_KINDS[version].values())


def param_tensor_specs(fqn: str, shape: tuple[int, ...], period: int,
                       version: int = VERSION) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A stateful agreed parameter's entries: key -> (dtype, global shape).

    The codes have the parameter's shape, the per-block tensors its block
    grid (v3: one, with a trailing 2); all shard with the parameter's
    placements (the trailing dimension is never sharded).
    """
    grid = grid_shape(tuple(shape), period)
    keys = param_tensor_keys(fqn, version)
    if version == VERSION:
        return {keys["codes"]: (torch.uint8, tuple(shape)), keys["grid"]: (torch.float32, grid + (2,))}
    return {keys["codes"]: (torch.uint8, tuple(shape)), keys["magnitude"]: (torch.float32, grid),
            keys["vmean"]: (torch.float32, grid)}


def pack_blocks(magnitude: torch.Tensor, vmean: torch.Tensor) -> torch.Tensor:
    """v3's grid entry from a shard's magnitude and vmean (block-grid shaped): a new tensor."""
    return torch.stack((magnitude, vmean), dim=-1)


def unpack_blocks(version: int, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(magnitude, vmean), block-grid shaped, from a parameter's entries by ``PARAM_TENSORS`` name."""
    if version == VERSION:
        grid = tensors["grid"]
        if grid.dim() == 0 or grid.shape[-1] != 2:
            raise FormatError(f"a v3 grid entry has shape {tuple(grid.shape)}, not (..., 2)")
        return grid[..., 0], grid[..., 1]
    return tensors["magnitude"], tensors["vmean"]


# ``docs/checkpoint_format.md``'s rows of these keys (``KindDescription.key_docs``): version -> (key kind,
# value, written by), after the header's row.
_RECORD = ('str (json): "blocking", "deterministic", "global_step", and per parameter in order: "fqn", "shape", '
           '"period" (0: no state yet), "step", "vmean_step", "group" (lr, beta1, beta2, eps, weight_decay)')
_RAW = " Stored as raw bytes (little-endian, no framing; see *Raw entries*)."
_CODEBOOK = ("codebook", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
             "every rank of the optimizer (same)")
KEY_DOCS: dict[int, tuple[tuple[str, str, str], ...]] = {
    3: (
        ("gefen", _RECORD, "every rank of the optimizer (same)"),
        _CODEBOOK,
        ("qcodes", "uint8, the parameter's shape and placements." + _RAW, "DTensor: each its shard"),
        ("grid", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) + (2,): [..., 0] the per-block "
         "magnitude, [..., 1] the per-block vmean, with the parameter's placements." + _RAW,
         "DTensor: each its shard"),
    ),
    2: (
        ("gefen", _RECORD, "every rank of the optimizer (same)"),
        _CODEBOOK,
        ("codes", "uint8, the parameter's shape and placements", "DTensor: each its shard"),
        ("magnitude", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) with the parameter's placements",
         "DTensor: each its shard"),
        ("vmean", "fp32, the block grid with the parameter's placements", "DTensor: each its shard"),
    ),
    1: (
        ("gefen", "str (json): nshards, and per parameter in order: fqn, global shape, "
         "group hyperparameters", "every rank of the optimizer (same)"),
        ("codes", "uint8, the parameter's global shape and placements", "DTensor: each its shard"),
        ("records", "int64 [1 + P, 7]: row 0 = global step, P; row 1 + i = parameter i's "
         "start, length, period, step, vmean_step, first block, number of blocks", "rank r"),
        ("blocks", "fp32 [blocks, 2]: magnitude, vmean, all parameters of the optimizer "
         "back to back", "rank r"),
        ("rank_codebook", "fp32 [256], sorted, ends -1 and +1", "rank r"),
    ),
}
