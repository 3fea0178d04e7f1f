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

from gefen_titan.checkpoint.format.schema import V2, V3, VERSION, FormatError, KeyRow, grid_shape

__all__ = ["ROWS", "V1_KINDS", "KEY_DOCS", "HYPER", "PARAM_TENSORS", "FACTORED", "optimizer_key", "codebook_key",
           "codes_key", "qcodes_key", "magnitude_key", "vmean_key", "grid_key", "vrow_key", "vcol_key", "records_key",
           "blocks_key", "rank_codebook_key", "param_tensor_names", "param_tensor_keys", "param_key_kinds",
           "factor_shapes", "param_tensor_specs", "pack_blocks", "unpack_blocks"]

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
    KeyRow("grid", "gefen/grid/{fqn}", raw=True),  # v3, v4: magnitude and vmean in one entry (factored: magnitude)
    KeyRow("vrow", "gefen/vrow/{fqn}", raw=True),  # v4: a factored parameter's row EMAs
    KeyRow("vcol", "gefen/vcol/{fqn}", raw=True),  # v4: its column EMAs
    KeyRow("records", "gefen/records/{opt}/{r}", small="tensor"),  # v1: a source rank's table
    KeyRow("blocks", "gefen/blocks/{opt}/{r}"),  # v1: its blocks' magnitude and vmean
    KeyRow("rank_codebook", "gefen/codebook/{opt}/{r}", small="tensor"),  # v1: its codebook
)}
ROWS: tuple[KeyRow, ...] = tuple(_ROW.values())
V1_KINDS = frozenset({"records", "blocks", "rank_codebook", "codes"})

# A stateful agreed parameter's tensors per version, in the order the
# adapters and tools list them, and their key kinds (v3's codes have a key of their own, stored raw);
# ``FACTORED``: those of a v4 parameter whose second moment is factored.
PARAM_TENSORS = {VERSION: ("codes", "grid"), V3: ("codes", "grid"), V2: ("codes", "magnitude", "vmean")}
FACTORED = ("codes", "grid", "vrow", "vcol")
_TENSOR_KINDS = {VERSION: {"codes": "qcodes", "grid": "grid", "vrow": "vrow", "vcol": "vcol"},
                 V3: {"codes": "qcodes", "grid": "grid"},
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
    """v3, v4: magnitude and vmean in one entry (``pack_blocks``; a factored parameter's: magnitude alone)."""
    return _ROW["grid"].key(fqn)


def vrow_key(fqn: str) -> str:
    """v4: a factored parameter's row EMAs."""
    return _ROW["vrow"].key(fqn)


def vcol_key(fqn: str) -> str:
    """v4: a factored parameter's column EMAs."""
    return _ROW["vcol"].key(fqn)


def records_key(opt: str, rank: int) -> str:
    return _ROW["records"].key(opt, rank)


def blocks_key(opt: str, rank: int) -> str:
    return _ROW["blocks"].key(opt, rank)


def rank_codebook_key(opt: str, rank: int) -> str:
    """v1: one codebook per optimizer per source rank."""
    return _ROW["rank_codebook"].key(opt, rank)


def param_tensor_names(version: int, factored: bool = False) -> tuple[str, ...]:
    """A stateful agreed parameter's tensors in ``version`` (``factored``: its second moment is, v4 only)."""
    if factored:
        if version != VERSION:
            raise FormatError(f"a factored second moment in a v{version} record (v{VERSION} introduced it)")
        return FACTORED
    return PARAM_TENSORS[version]


def param_tensor_keys(fqn: str, version: int = VERSION, factored: bool = False) -> dict[str, str]:
    """An agreed parameter's entries by ``param_tensor_names`` name."""
    return {name: _ROW[_TENSOR_KINDS[version][name]].key(fqn) for name in param_tensor_names(version, factored)}


def param_key_kinds(version: int) -> tuple[str, ...]:
    """The key kinds of an agreed parameter's entries in ``version`` (v3: qcodes, grid; v4 also vrow, vcol)."""
    return tuple(_TENSOR_KINDS[version].values())


def factor_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(rows, columns) of a factored parameter (or of a local shard of it): ``shape[:-1]`` and
    ``shape[:-2] + shape[-1:]``."""
    shape = tuple(shape)
    return shape[:-1], shape[:-2] + shape[-1:]


def param_tensor_specs(fqn: str, shape: tuple[int, ...], period: int, version: int = VERSION,
                       factored: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A stateful agreed parameter's entries: key -> (dtype, global shape).

    The codes have the parameter's shape, the per-block tensors its block
    grid (v3, v4: one, with a trailing 2; a factored parameter's with a
    trailing 1, the magnitude); all shard with the parameter's placements
    (the trailing dimension is never sharded). A factored parameter's
    ``vrow`` and ``vcol`` have ``factor_shapes(shape)``.
    """
    grid = grid_shape(tuple(shape), period)
    keys = param_tensor_keys(fqn, version, factored)
    if factored:
        rows, cols = factor_shapes(shape)
        return {keys["codes"]: (torch.uint8, tuple(shape)), keys["grid"]: (torch.float32, grid + (1,)),
                keys["vrow"]: (torch.float32, rows), keys["vcol"]: (torch.float32, cols)}
    if version in (V3, VERSION):
        return {keys["codes"]: (torch.uint8, tuple(shape)), keys["grid"]: (torch.float32, grid + (2,))}
    return {keys["codes"]: (torch.uint8, tuple(shape)), keys["magnitude"]: (torch.float32, grid),
            keys["vmean"]: (torch.float32, grid)}


def pack_blocks(magnitude: torch.Tensor, vmean: torch.Tensor | None) -> torch.Tensor:
    """v3's grid entry from a shard's magnitude and vmean (block-grid shaped): a new tensor; a factored
    parameter's (``vmean`` None) holds the magnitude alone."""
    if vmean is None:
        return magnitude.unsqueeze(-1).clone()
    return torch.stack((magnitude, vmean), dim=-1)


def unpack_blocks(version: int, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(magnitude, vmean), block-grid shaped, from a parameter's entries by ``param_tensor_names`` name;
    vmean None for a factored parameter's (its grid holds the magnitude alone)."""
    if version in (V3, VERSION):
        grid = tensors["grid"]
        want = 1 if "vrow" in tensors else 2
        if grid.dim() == 0 or grid.shape[-1] != want:
            raise FormatError(f"a v{version} grid entry has shape {tuple(grid.shape)}, not (..., {want})")
        return (grid[..., 0], None) if want == 1 else (grid[..., 0], grid[..., 1])
    return tensors["magnitude"], tensors["vmean"]


# ``docs/checkpoint_format.md``'s rows of these keys (``KindDescription.key_docs``): version -> (key kind,
# value, written by), after the header's row.
_RECORD = ('str (json): "blocking", "deterministic", "global_step", and per parameter in order: "fqn", "shape", '
           '"period" (0: no state yet), "step", "vmean_step", "group" (lr, beta1, beta2, eps, weight_decay)')
_RECORD_V4 = _RECORD + ('; v4: "second_moment": "factored" for a parameter whose second moment is factored (absent: '
                        'the block vmean), whose "vmean_step" then counts the factored EMAs\' steps')
_RAW = " Stored as raw bytes (little-endian, no framing; see *Raw entries*)."
_CODEBOOK = ("codebook", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
             "every rank of the optimizer (same)")
KEY_DOCS: dict[int, tuple[tuple[str, str, str], ...]] = {
    4: (
        ("gefen", _RECORD_V4, "every rank of the optimizer (same)"),
        _CODEBOOK,
        ("qcodes", "uint8, the parameter's shape and placements." + _RAW, "DTensor: each its shard"),
        ("grid", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) + (2,): [..., 0] the per-block "
         "magnitude, [..., 1] the per-block vmean, with the parameter's placements; a factored parameter's + (1,): "
         "the magnitude alone." + _RAW, "DTensor: each its shard"),
        ("vrow", "fp32, shape[:-1]: a factored parameter's EMA of grad²'s row means (a grouped weight (E, out, in): "
         "[E, out]), placed like the parameter's leading dims." + _RAW, "DTensor: each its rows"),
        ("vcol", "fp32, shape[:-2] + shape[-1:]: its EMA of grad²'s column means ([E, in]), placed like the "
         "parameter's last dim (and experts)." + _RAW, "DTensor: each its columns"),
    ),
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
