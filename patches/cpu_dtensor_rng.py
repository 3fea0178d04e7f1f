"""cpu_dtensor_rng: sharded random init on CPU meshes draws the full tensor, then slices.

What it fixes (silent; no exception)
    DTensor's random ops (``normal_``, ``uniform_``, ...) only keep sharded
    initialization consistent on CUDA-like meshes, via ``OffsetBasedRNGTracker``
    (Philox offsets). On a CPU mesh ``is_rng_supported_mesh`` is False, torch
    only warns::

        UserWarning: DTensor random operators may not have complete support on cpu device mesh

    and every rank runs the op on its local shard with its local generator. All
    ranks are seeded identically (torchtitan ``set_determinism``), so every FSDP
    shard gets the *same* draws. Measured on the llama3 debug model with
    ``data_parallel_shard_degree=2``: rows ``[0, n/2)`` equal rows ``[n/2, n)``
    for ``tok_embeddings``, every ``wo``/``w1``/``w2``/``w3`` -- the initialized
    model has duplicated rows and depends on the world size.

What it does
    Registers DTensor custom op handlers for the in-place random fills used by
    ``nn.init`` (``aten.normal_.default``, ``aten.uniform_.default``; e.g.
    ``trunc_normal_`` is ``uniform_`` + elementwise ops). For a DTensor on a CPU
    mesh with Shard/Replicate placements the handler draws the *full* tensor
    with the ordinary CPU generator (identical on every rank, so ranks stay in
    RNG lock-step) and copies this rank's part into the local shard, split the
    way DTensor splits it (``distribute_tensor(full, mesh, placements,
    src_data_rank=None)``: no communication). The result equals what a single
    process draws for the unsharded tensor, for any world size and mesh
    (checked bit-for-bit, including uneven shards, and FSDP2 x TP 2-D meshes,
    where FSDP2 marks TP-sharded dims ``_StridedShard``).

    Without the ``_StridedShard`` case (first version of this patch) an FSDP 2 x
    TP 2 init fell through to DTensor's default: every param whose fsdp
    placement is ``_StridedShard(0, sf=2)`` (embeddings, wqkv, w1, w3, lm_head)
    drew only its local shard, the CPU RNG streams then drifted, and *every*
    parameter after ``tok_embeddings`` differed from the 1-rank init (step-1
    loss 8.063 vs 8.082 for FSDP 2 on the same data). Anything else (non-CPU
    mesh, Partial placements, meta tensors) is re-dispatched to DTensor's
    default handling. Cost: one transient full-size tensor per init call, which
    is fine at CPU-test scale.

Scope
    CPU only: the handlers are installed only when torchtitan's device type is
    "cpu" (after ``cpu_device``), and they defer to DTensor for non-CPU meshes,
    so CUDA runs keep ``OffsetBasedRNGTracker``.

Upstream status
    Unfixed upstream as of torch 2.13 (DTensor random ops document CPU meshes as
    unsupported) and torchtitan 0.3.0.
"""

from __future__ import annotations

import inspect

from ._util import PatchTargetChanged, is_marked, mark, require_attr

NAME = "cpu_dtensor_rng"


def _ops():
    import torch

    aten = torch.ops.aten
    return (aten.normal_.default, aten.uniform_.default)


def _handler(op_call, args, kwargs):
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    self_dt = args[0]
    applicable = (
        isinstance(self_dt, DTensor)
        and self_dt.device_mesh.device_type == "cpu"
        and not self_dt._local_tensor.is_meta
        and all(_shard_or_replicate(p) for p in self_dt.placements)
    )
    if not applicable:
        return _redispatch(op_call, args, kwargs)

    local = self_dt._local_tensor
    full = torch.empty(self_dt.shape, dtype=local.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)  # plain tensor: default CPU generator
    # DTensor's own split of the (rank-identical) full tensor, without
    # communication: right for Shard, Replicate and FSDP2 x TP's
    # _StridedShard (whose shard is not one block of the global tensor in
    # general), even and uneven.
    mine = distribute_tensor(
        full, self_dt.device_mesh, self_dt.placements, src_data_rank=None
    )._local_tensor
    if tuple(mine.shape) != tuple(local.shape):
        # Placement we do not understand (e.g. a future layout): be safe.
        raise RuntimeError(
            "gefen_titan.patches.cpu_dtensor_rng: computed local shape "
            f"{tuple(mine.shape)} != local tensor shape {tuple(local.shape)} for "
            f"placements {self_dt.placements}"
        )
    with torch.no_grad():
        local.copy_(mine)
    return self_dt


def _shard_or_replicate(p) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    # _StridedShard is not ``is_shard()`` (nor a Shard subclass) in torch 2.13.
    return p.is_shard() or p.is_replicate() or isinstance(p, _StridedShard)


def _redispatch(op_call, args, kwargs):
    """Run DTensor's default dispatch for ``op_call`` (bypassing this handler)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    saved = handlers.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        if saved is not None:
            handlers[op_call] = saved


mark(_handler)


def apply() -> bool:
    import torchtitan.tools.utils as tu
    from torch.distributed import tensor as dt
    from torch.distributed.tensor import DTensor, placement_types

    dispatcher = require_attr(DTensor, "_op_dispatcher")
    handlers = require_attr(dispatcher, "_custom_op_handlers")
    random_ops = require_attr(dispatcher, "_random_ops")
    require_attr(placement_types, "_StridedShard")
    if "src_data_rank" not in inspect.signature(require_attr(dt, "distribute_tensor")).parameters:
        raise PatchTargetChanged(
            "gefen_titan.patches.cpu_dtensor_rng: distribute_tensor() no longer "
            "takes src_data_rank (local split without communication)"
        )
    if not isinstance(handlers, dict):
        raise PatchTargetChanged(
            "gefen_titan.patches.cpu_dtensor_rng: DTensor._op_dispatcher."
            "_custom_op_handlers is no longer a dict"
        )
    ops = _ops()
    if all(is_marked(handlers.get(op)) for op in ops):
        return True
    if tu.device_type != "cpu":
        return False  # accelerator run: keep DTensor's OffsetBasedRNGTracker
    for op in ops:
        if op not in random_ops:
                raise PatchTargetChanged(
                f"gefen_titan.patches.cpu_dtensor_rng: {op} is no longer one of "
                "DTensor's random ops; re-verify the patch"
            )
        if op in handlers and not is_marked(handlers[op]):
                raise PatchTargetChanged(
                f"gefen_titan.patches.cpu_dtensor_rng: DTensor already has a custom "
                f"handler for {op}; refusing to replace it"
            )
        handlers[op] = _handler
    return True


def is_applied() -> bool:
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return all(is_marked(handlers.get(op)) for op in _ops())
