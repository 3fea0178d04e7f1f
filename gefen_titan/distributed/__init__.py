"""The few distributed helpers every part of gefen-titan needs, once.

* DTensors: ``local`` (this rank's shard, or the tensor itself) and
  ``like_param`` (a local tensor presented as a DTensor with a parameter's
  placements, for DCP);
* agreement: ``raise_on_any_rank`` raises the same error on every rank when
  any rank has one, ``any_rank`` ORs a flag over the world and
  ``max_over_ranks`` takes the worst of a graded verdict. A rank that
  raised alone would leave the others waiting in their next collective, so
  every check whose outcome can differ between ranks goes through these;
* ``comm_device``: where a collective's tensors must live (the current CUDA
  device under NCCL, the CPU under gloo);
* ``free_port``: a rendezvous port for ranks started on this host.

Where a shard lies (placements -> the global box a rank holds) is
``gefen_titan.distributed.layout``'s, the one module that computes it.

Every function also works without a process group (one process), where the
agreement is the rank's own verdict.
"""

from __future__ import annotations

import math
import random
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gefen_titan.distributed.layout import column_placements, leading_placements, placements_from_front

__all__ = [
    "all_gather_objects",
    "any_rank",
    "comm_device",
    "free_port",
    "is_distributed",
    "like_param",
    "like_param_cols",
    "like_param_rows",
    "local",
    "max_over_ranks",
    "rank_and_world",
    "raise_on_any_rank",
]


def is_distributed() -> bool:
    """A process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def comm_device() -> torch.device:
    """The device of a collective's tensors: NCCL needs CUDA, gloo the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(param: torch.Tensor, local_tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local_tensor`` as the shard of a global tensor of ``shape`` placed like ``param``.

    Gefen's state lives on each rank's shard; DCP reshards it only when it is
    handed over as a DTensor with the parameter's mesh and placements (and the
    global shape of what it holds: the parameter's, or its block grid's). A
    plain parameter's state is returned as it is.
    """
    if not isinstance(param, DTensor):
        return local_tensor
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    placements = tuple(param.placements)
    if len(shape) != param.dim():  # trailing dims (v3's packed grid): a dim counted from the end moves
        placements = placements_from_front(param)
    return DTensor.from_local(local_tensor, param.device_mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def like_param_rows(param: torch.Tensor, local_rows: torch.Tensor) -> torch.Tensor:
    """``local_rows`` (one value per local row of ``param``) as the shard of a tensor of
    ``param``'s leading dims (``[rows]`` for a matrix, ``[experts, rows]`` for a 3-D
    grouped weight), placed like those dims of ``param``.

    Shards of those dims stay (FSDP's, TP's row cut, EP's expert cut, strided
    or not); every other mesh dim replicates it (the ranks that split a row
    between them hold the same values for it). A plain parameter's rows are
    returned as they are.
    """
    if not isinstance(param, DTensor):
        return local_rows
    shape = tuple(param.shape[:-1])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local_rows, param.device_mesh, leading_placements(param, len(shape)),
                              run_check=False, shape=shape, stride=stride)


def like_param_cols(param: torch.Tensor, local_cols: torch.Tensor) -> torch.Tensor:
    """``local_cols`` (one value per local column of every matrix of ``param``: shape[:-2] + shape[-1:]) as
    the shard of that tensor, placed like those dims of ``param`` (``layout.column_placements``); a cut of
    the rows replicates it. A plain parameter's columns are returned as they are."""
    if not isinstance(param, DTensor):
        return local_cols
    shape = tuple(param.shape[:-2]) + (param.shape[-1],)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local_cols, param.device_mesh, column_placements(param), run_check=False,
                              shape=shape, stride=stride)


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (collective)."""
    if not is_distributed():
        return flag
    t = torch.tensor([int(flag)], device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(value: int) -> int:
    """The largest of every rank's ``value`` (collective; ``value`` alone): one verdict of a few
    grades in one all-reduce."""
    if not is_distributed():
        return value
    t = torch.tensor([value], device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective; ``[obj]`` alone)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_on_any_rank(error: str | None, what: str, exc: type[Exception]) -> None:
    """Raise ``exc(f"{what}: ...")`` on every rank if any rank has an ``error``.

    Collective: every rank calls it, with its own verdict (None: fine). The
    message joins the distinct errors of all ranks, so each rank's log says
    what went wrong anywhere. Costs one all-reduce when nothing failed.
    """
    if not is_distributed():
        if error:
            raise exc(f"{what}: {error}")
        return
    if not any_rank(bool(error)):
        return
    errors = all_gather_objects(error)
    raise exc(f"{what}: " + "; ".join(sorted({e for e in errors if e})))


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default (not Linux: bind(0) below)


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 for a rank-0 store to listen on.

    Not from ``bind(0)``: that hands out a port of the kernel's ephemeral range,
    which the kernel may give to any outgoing connection (another job's gloo
    or torchft peers) before the store listens on it; a fault-tolerance
    test's group start failed so once (EADDRINUSE). A port below that range
    is never given to an outgoing connection; another listener may still take
    it first (rare).
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low > 10_001 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
