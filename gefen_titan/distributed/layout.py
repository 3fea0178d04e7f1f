"""Where a parameter's shard lies: its placements on its mesh -> the global box each rank holds.

The one home of this knowledge. Agreed blocking (which last-dim cuts a block
must not cross), GefenMuon's sharded step (which rows and columns of a matrix,
or of an expert's slice, each member holds), the checkpoint adapters (a
rank's run of the flattened parameter, the placements of a state tensor
shaped like part of the parameter) and the distributed helpers all ask it;
nothing else computes a local shard.

**FSDP2's real cuts, not DTensor's split.** A shard is a box: per tensor
dim, one contiguous range of global indices (``Box``). Plain ``Shard``
placements apply left to right, each a ``torch.chunk`` of what the earlier
ones left of its dim (chunks of ``ceil(n / k)``, the last ones short or
empty), which is what DTensor, FSDP2, TP and EP all do. ``_StridedShard`` is
how FSDP2 records a dim that another placement to its right cut first
(FSDP2 over TP's colwise ``Shard(0)``; over EP's ``Shard(0)`` of the
experts): that placement cut first, then FSDP2 took a ``torch.chunk`` of each
of its shards. DTensor's own strided split (``distribute_tensor``,
``compute_local_shape_and_global_offset``) names other rows at uneven sizes
(FSDP 3 x TP 2 at 7 rows: the last row on coordinate (2, 0), where FSDP2
holds it on (2, 1)), so with a ``_StridedShard`` the cuts are replayed as
FSDP2 made them: right to left. ``tests/unit/test_layout.py`` pins every
placement the trainer makes (FSDP2 even and uneven, TP colwise and rowwise,
FSDP2 over TP, HSDP, EP over the experts with efsdp ``Shard(0)`` and
``Shard(1)``, pipeline stages' sub-meshes) against real ``fully_shard`` /
DTensor shards of ``arange``.

**DCP writes DTensor's view.** A checkpoint's chunk offsets come from
DTensor's ``compute_local_shape_and_global_offset``; where that disagrees
with the data FSDP2 holds, a save would put rows under other rows' offsets.
``dcp_disagreement`` says so, and the optimizer refuses such a parameter
before its first step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # DCP's view, at a coordinate
from torch.distributed.tensor.placement_types import _StridedShard

from gefen_titan.errors import UserError

__all__ = [
    "Box", "LayoutError", "chunk", "column_placements", "copy_groups", "mesh_dims_cutting",
    "dcp_disagreement", "holds_first_copy", "last_dim_cuts",
    "leading_placements", "local_box", "mesh_coordinate", "param_box", "placements_cutting", "placements_from_front",
    "shard_box", "shard_indices",
]


class LayoutError(UserError, ValueError):
    """Placements this module cannot place (and so nothing in gefen-titan can)."""


@dataclass(frozen=True)
class Box:
    """The global indices a shard holds: per dim ``[offsets[d], offsets[d] + sizes[d])``.

    The local tensor holds them in row-major order of the box, so its shape
    is ``sizes``.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))

    def indices(self, dim: int) -> torch.Tensor:
        return torch.arange(self.offsets[dim], self.offsets[dim] + self.sizes[dim])

    def flat_run(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """(start, length) of the box in the row-major flattened tensor of ``shape``, or
        None when it is no single run (row-major: single indices on the dims before some
        dim k, any range on k, whole dims after it)."""
        if self.numel == 0:
            return 0, 0
        n = len(shape)
        if not any(all(self.sizes[d] == 1 for d in range(k)) and
                   all(self.sizes[d] == shape[d] for d in range(k + 1, n)) for k in range(max(n, 1))):
            return None
        start = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(self.offsets))
        return start, self.numel


def chunk(start: int, size: int, parts: int, i: int) -> tuple[int, int]:
    """(start, size) of piece ``i`` of ``torch.chunk`` of ``[start, start + size)`` into ``parts``."""
    step = -(-size // parts) if size else 0
    lo = min(size, i * step)
    return start + lo, min(size, lo + step) - lo


def _is_shard(pl: Any) -> bool:
    # _StridedShard is no Shard subclass, and its is_shard() is False.
    return type(pl) in (Shard, _StridedShard)


def _order(ndim: int, mesh_shape: Sequence[int], placements: Sequence[Any]) -> list[int]:
    """The mesh dims in the order their cuts were made (see the module doc), checked."""
    for pl in placements:
        if not pl.is_replicate() and not _is_shard(pl):
            raise LayoutError(f"placement {pl} (only Shard, _StridedShard and Replicate hold a parameter)")
    order = list(range(len(placements)))
    strided = [i for i, pl in enumerate(placements) if type(pl) is _StridedShard]
    if not strided:
        return order
    for i in strided:
        pl = placements[i]
        d = pl.dim % ndim
        later = math.prod(mesh_shape[j] for j in range(i + 1, len(placements))
                          if _is_shard(placements[j]) and placements[j].dim % ndim == d)
        if pl.split_factor != later:
            raise LayoutError(f"placements {tuple(placements)}: _StridedShard({d}, split_factor={pl.split_factor}) "
                              f"is not FSDP2's over a cut of {later} to its right")
    order.reverse()
    return order


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any],
              coord: Sequence[int]) -> Box:
    """The box the rank at mesh coordinate ``coord`` holds of a tensor of ``shape``."""
    shape = tuple(int(n) for n in shape)
    offsets, sizes = [0] * len(shape), list(shape)
    for m in _order(len(shape), mesh_shape, placements):
        pl = placements[m]
        if pl.is_replicate():
            continue
        d = pl.dim % len(shape)
        offsets[d], sizes[d] = chunk(offsets[d], sizes[d], int(mesh_shape[m]), int(coord[m]))
    return Box(tuple(offsets), tuple(sizes))


def shard_indices(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any],
                  coord: Sequence[int]) -> list[torch.Tensor]:
    """Per tensor dim, the global indices the shard at ``coord`` holds (``shard_box`` as index lists)."""
    box = shard_box(shape, mesh_shape, placements, coord)
    return [box.indices(d) for d in range(len(box.sizes))]


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...] | None:
    """This rank's coordinate on ``mesh`` (None off it), from the process group's rank.

    What ``DeviceMesh.get_coordinate`` says in a job (one rank per process);
    computed here from ``dist.get_rank()`` because a mesh FSDP2 concatenates
    keeps the rank it was made under, which differs when one process plays
    several ranks (the tests' fake process group).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    where = (mesh.mesh == rank).nonzero()
    return tuple(int(i) for i in where[0]) if len(where) else None


def param_box(param: torch.Tensor, coord: Sequence[int] | None = None) -> Box:
    """The box of ``param`` the rank at ``coord`` of its mesh holds (default: this rank's).

    A plain tensor is whole. A rank outside the DTensor's mesh holds nothing.
    """
    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return Box((0,) * len(shape), shape)
    if coord is None:
        coord = mesh_coordinate(param.device_mesh)
        if coord is None:
            return Box((0,) * len(shape), (0,) * len(shape))
    return shard_box(shape, tuple(param.device_mesh.shape), tuple(param.placements), coord)


def local_box(param: torch.Tensor) -> Box:
    """This rank's box of ``param``, checked against the local tensor it holds."""
    box = param_box(param)
    held = tuple(param.to_local().shape) if isinstance(param, DTensor) else tuple(param.shape)
    if box.sizes != held:
        raise LayoutError(f"the local shard is {held}, the placements {tuple(param.placements)} say {box.sizes}")
    return box


def dcp_disagreement(fqn: str, param: torch.Tensor) -> str | None:
    """None if DCP's view of ``param``'s shard (DTensor's) is the box the rank holds, else why not.

    DCP writes every shard under DTensor's offsets; where they name other
    elements than FSDP2 holds (an uneven ``_StridedShard``), a checkpoint of
    it, the parameter's own included, would put the data at wrong places.
    """
    coord = mesh_coordinate(param.device_mesh) if isinstance(param, DTensor) else None
    if coord is None:
        return None
    box = param_box(param, coord)
    sizes, offsets = _compute_local_shape_and_global_offset(tuple(param.shape), tuple(param.device_mesh.shape),
                                                            list(coord), list(param.placements))
    if tuple(sizes) == box.sizes and (box.numel == 0 or tuple(offsets) == box.offsets):
        return None
    return (f"{fqn}: this rank holds {box.sizes} at {box.offsets} of {tuple(param.shape)}, but DTensor (and DCP's "
            f"checkpoint) place it at {tuple(offsets)} with shape {tuple(sizes)} under {tuple(param.placements)} "
            "(an uneven FSDP2 cut of a tensor-/expert-parallel shard); a checkpoint would store its rows at other "
            "rows' places. Choose degrees that divide that dimension evenly")


def last_dim_cuts(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any],
                  dims: Sequence[int]) -> list[int]:
    """Sizes and offsets of the last dim of every shard over the mesh dims ``dims``
    (the others at coordinate 0): the column cuts a block must not cross."""
    out: list[int] = []
    coords = [[0] * len(mesh_shape)]
    for d in dims:
        coords = [c[:d] + [i] + c[d + 1:] for c in coords for i in range(mesh_shape[d])]
    for coord in coords:
        box = shard_box(shape, mesh_shape, placements, coord)
        out += [box.sizes[-1], box.offsets[-1]]
    return out


def holds_first_copy(param: torch.Tensor) -> bool:
    """True on exactly one holder of each element of a DTensor: coordinate 0 of every
    ``Replicate`` mesh dim (replicas, HSDP's included, count once); False off its mesh."""
    coord = mesh_coordinate(param.device_mesh)
    if coord is None:
        return False
    return all(c == 0 for c, pl in zip(coord, param.placements) if pl.is_replicate())


def copy_groups(param: torch.Tensor) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Every copy of a DTensor: lists of (global rank, mesh coordinate).

    A copy is the tensor cut over the mesh dims that shard it, at one
    coordinate of the ``Replicate`` dims; its members are in row-major order
    of their coordinates on the sharding dims.
    """
    mesh = param.device_mesh
    ranks = mesh.mesh
    shape = tuple(mesh.shape)
    sharding = [d for d, pl in enumerate(param.placements) if not pl.is_replicate()]
    replicated = [d for d in range(len(shape)) if d not in sharding]
    groups = []
    for rep in itertools.product(*(range(shape[d]) for d in replicated)):
        members = []
        for sh in itertools.product(*(range(shape[d]) for d in sharding)):
            coord = [0] * len(shape)
            for d, i in itertools.chain(zip(replicated, rep), zip(sharding, sh)):
                coord[d] = i
            members.append((int(ranks[tuple(coord)]), tuple(coord)))
        groups.append(members)
    return groups


def leading_placements(param: DTensor, ndim: int) -> tuple[Any, ...]:
    """Placements of a tensor shaped like ``param``'s first ``ndim`` dims (one value per
    row: NorMuon's rows), so that each rank holds the values of the rows of its box.

    Shards of those dims stay (plain or strided); every other mesh dim
    replicates it (the ranks that split a row between them hold the same
    values for it).
    """
    return tuple(pl if _is_shard(pl) and pl.dim % param.dim() < ndim else Replicate() for pl in param.placements)


def placements_from_front(param: DTensor) -> tuple[Any, ...]:
    """``param``'s placements with every sharded dim counted from the front, for a tensor
    that keeps ``param``'s leading dims but not its number of dims (v3's packed block grid)."""
    out = []
    for pl in param.placements:
        if _is_shard(pl) and pl.dim < 0:
            pl = Shard(pl.dim + param.dim()) if type(pl) is Shard else \
                _StridedShard(pl.dim + param.dim(), split_factor=pl.split_factor)
        out.append(pl)
    return tuple(out)


def mesh_dims_cutting(param: torch.Tensor, dim: int) -> list[int]:
    """The mesh dims whose placement cuts tensor dim ``dim`` of ``param`` (plain or strided shards), in mesh
    order; none for a plain tensor. The ranks along such a mesh dim hold different parts of ``dim`` and the
    same part of every dim no other of these mesh dims cuts: a sum along ``dim`` is completed by adding
    the partial sums over these mesh dims."""
    if not isinstance(param, DTensor):
        return []
    return placements_cutting(param.placements, param.dim(), dim)


def placements_cutting(placements: Sequence[Any], ndim: int, dim: int) -> list[int]:
    """``mesh_dims_cutting`` from a tensor's placements and number of dims (the scale plan's parameters)."""
    d = dim % ndim
    return [i for i, pl in enumerate(placements) if _is_shard(pl) and pl.dim % ndim == d]


def column_placements(param: DTensor) -> tuple[Any, ...]:
    """Placements of a tensor of ``param``'s columns (shape[:-2] + shape[-1:]: one value per column of
    every matrix, the factored second moment's ``v_col``), so that each rank holds the values of the
    columns of its box: the cuts of the last dim and of the leading (batch) dims stay, counted for the
    shorter tensor; a cut of the rows (dim -2) replicates it."""
    nd = param.dim()
    out = []
    for pl in param.placements:
        if not _is_shard(pl) or pl.dim % nd == nd - 2:
            out.append(Replicate())
            continue
        d = pl.dim % nd
        d = d - 1 if d == nd - 1 else d
        out.append(Shard(d) if type(pl) is Shard else _StridedShard(d, split_factor=pl.split_factor))
    return tuple(out)
