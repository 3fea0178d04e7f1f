"""Gefen's factored second moment, sharded and exact at every layout (``[optimizer.gefen] second_moment``).

gefen-x's default, ``factored_v_2d=True``, keeps for each 2-D parameter fp32
EMAs of grad²'s row means ``R`` and column means ``C`` instead of a block
``vmean``, and rebuilds a per-element second moment ``V ≈ outer(R, C) /
mean(R)`` (Adafactor, Shazeer & Stern 2018). It cannot do that on a shard
(a DTensor falls back to ``vmean``): a rank's rows and columns are parts of
the matrix's. This step does it on shards, and so that the state and the
parameters are the same bits at every layout (FSDP, TP, HSDP, PP, EP,
offload, one rank):

* **Row and column sums** of grad² (fp32 squares, as gefen-x) are taken in
  exact fixed point (``optim.axis_sums``): a row's sum is completed over the
  mesh dims that cut its columns, a column's over those that cut its rows
  (``distributed.layout.mesh_dims_cutting``), as int64 all-reduces, after one
  uint8 all-reduce MAX of each slice's exponent. Integers add exactly in any order,
  so the sums do not depend on where the cuts fall; the means are then
  rounded to fp32 once. Replicated mesh dims (HSDP's, a TP-replicated
  parameter's) hold the same values and take no part.
* **mean(R)** per matrix is summed the same way over the mesh dims that cut
  the rows.
* Everything else is elementwise on the local rows and columns (``V``, the
  stepsize, the update) or per block (the quantized momentum: gefen-x's own
  arithmetic, ``gefenx.gefen_momentum_update``, or the CPU kernel's, bit for
  bit the same: ``cpu_step.factored_momentum``; agreed blocks never cross a
  cut), so it is layout-free.

Which parameters: every parameter with two dims or more. A 2-D weight is one
matrix; a grouped experts' weight ``(E, out, in)`` is E matrices, each with
its own ``R [out]``, ``C [in]`` and mean (gefen-x factors 2-D only). 0-D and
1-D parameters keep the block ``vmean`` (they are one block or per element).

The state, per parameter on this rank: the codes and block magnitudes as
before (no ``vmean``), ``v_row`` (the local shard's ``shape[:-1]``),
``v_col`` (``shape[:-2] + shape[-1:]``) and ``factored_step`` (the EMAs'
age, for their bias correction; the records' ``vmean_step``). Under gefen-x's
own key names, so ``gefenx.gefen_read`` returns it.

Collectives per factored parameter and step, each over one mesh dim that
cuts the parameter: uint8 exponents, then int64 sums, of the rows (over the
dims cutting columns) and of the columns (over the dims cutting rows), and
one exponent and sum per matrix for mean(R); none on one rank or for a dim
no mesh dim cuts: 9 bytes per slice. ``collective_bytes`` counts them for the
scale plan (``benchmarks/scale_factored.py``: under 1% of the gradient's
reduce-scatter bytes; ``docs/scale.md``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gefen_titan.distributed import comm_device, local
from gefen_titan.distributed.layout import mesh_dims_cutting
from gefen_titan.optim import axis_sums, cpu_step
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kinds.gefen.keys import factor_shapes

__all__ = ["MODES", "FactoredStep", "install", "is_factored", "factors", "collective_bytes", "rebuilt"]

MODES = ("block", "factored")

_INSTALLED: weakref.WeakKeyDictionary[Optimizer, FactoredStep] = weakref.WeakKeyDictionary()


def factors(p: torch.Tensor) -> bool:
    """Whether the factored moment covers a parameter of this shape (two dims or more)."""
    return p.dim() >= 2


def is_factored(optim: Optimizer, p: torch.Tensor) -> bool:
    """Whether ``p``'s second moment is factored in ``optim``: a function of the run's options and the
    parameter's shape alone, the same on every rank (the records must agree)."""
    return optim in _INSTALLED and factors(p)


def collective_bytes(local_shape: Sequence[int], cuts_rows: bool, cuts_cols: bool) -> int:
    """Bytes one rank puts into the factored step's all-reduces for one parameter per step and mesh dim
    that cuts it (payloads; an all-reduce delivers as much): an exponent byte and an int64 sum per local
    row when the columns are cut, per local column and per matrix (mean(R)) when the rows are cut."""
    shape = tuple(local_shape)
    batch = math.prod(shape[:-2])
    per = axis_sums.EXPONENT_DTYPE.itemsize + axis_sums.SUM_DTYPE.itemsize
    rows = batch * shape[-2] * per if cuts_cols else 0
    cols = batch * shape[-1] * per + batch * per if cuts_rows else 0
    return rows + cols


def rebuilt(v_row: torch.Tensor, v_col: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A whole factored parameter's per-element second moment, as the step rebuilds it before the bias
    correction: per matrix ``outer(v_row, v_col) / max(mean(v_row), tiny)`` (for the offline tools and the
    validation, which hold the whole parameter; the step's mean is the exact sum's, this one fp64's)."""
    shape = tuple(shape)
    rows, cols = v_row.float().reshape(-1, shape[-2]), v_col.float().reshape(-1, shape[-1])
    mean = rows.double().mean(dim=1).float().clamp_(min=torch.finfo(torch.float32).tiny)
    return (rows.unsqueeze(2) * cols.unsqueeze(1)).div_(mean.view(-1, 1, 1)).reshape(shape)


def install(optim: Optimizer) -> FactoredStep:
    """Route ``optim``'s matrices through the factored step (offered each parameter before the CPU kernel
    and gefen-x: ``gefenx.route_gefen_step``)."""
    step = FactoredStep(optim)
    gx.route_gefen_step(optim, step)
    _INSTALLED[optim] = step
    return step


def _reduce(t: torch.Tensor, param: torch.Tensor, dims: list[int], op: dist.ReduceOp) -> torch.Tensor:
    """``t`` all-reduced over each mesh dim in ``dims`` (the ranks along one hold the same slices of ``t``:
    the same shape, so a tensor empty on one rank is empty on all of them and makes no call)."""
    if not dims or t.numel() == 0:
        return t
    x = t.to(comm_device()).contiguous()
    for d in dims:
        dist.all_reduce(x, op=op, group=param.device_mesh.get_group(d))
    return x.to(t.device)


def _exact_sums(x: torch.Tensor, dim: int, param: torch.Tensor, over: list[int], n: int) -> torch.Tensor:
    """fp64: the sums of ``x`` (>= 0) along ``dim``, completed over the mesh dims ``over``, the same at
    every layout (``axis_sums``; ``n``: the slices' length over all ranks)."""
    codes = _reduce(axis_sums.exponents(x, dim), param, over, dist.ReduceOp.MAX)
    total = _reduce(axis_sums.sums(x, dim, codes, n), param, over, dist.ReduceOp.SUM)
    return axis_sums.values(total, codes, n)


class FactoredStep:
    """One Gefen optimizer's step of its factored parameters: ``(group, p, grad) -> bool`` (False: not a
    factored parameter; the block step takes it)."""

    def __init__(self, optim: Optimizer) -> None:
        self.optim = optim
        self.taken = 0

    def __call__(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        if not factors(p):
            return False
        optim = self.optim
        g = local(grad)
        lp = local(p)
        shape = tuple(g.shape)
        batch, rows_here, cols_here = math.prod(shape[:-2]), shape[-2], shape[-1]
        rows, cols = int(p.shape[-2]), int(p.shape[-1])
        cuts_rows, cuts_cols = mesh_dims_cutting(p, -2), mesh_dims_cutting(p, -1)
        beta1, beta2, eps = group["beta1"], group["beta2"], group["eps"]

        x = g.detach().float().square().reshape(batch, rows_here, cols_here)
        row_ms = (_exact_sums(x, 2, p, cuts_cols, cols) / cols).float()
        col_ms = (_exact_sums(x, 1, p, cuts_rows, rows) / rows).float()
        del x
        empty = g.numel() == 0
        if empty:  # no element here, but maybe whole rows or columns: kept, as every rank holding them does
            kept = gx.gefen_empty_shard_factors(optim, p)
            if kept is None:
                kept = tuple(torch.zeros(s, dtype=torch.float32, device=g.device) for s in factor_shapes(shape))
                gx.gefen_set_empty_shard_factors(optim, p, *kept)
            v_row_t, v_col_t = kept
        else:
            period = gx.period(optim, p)
            if not period:
                raise ValueError("the factored second moment needs agreed blocking to set the period first")
            grad_view = g.reshape(-1, period)
            if gx.gefen_factored_state(optim, p) is None:
                gx.gefen_factored_init(optim, p, grad_view, *factor_shapes(shape))
            step, fstep = gx.gefen_factored_advance(optim, p)
            st = gx.gefen_factored_state(optim, p)
            v_row_t, v_col_t = st.v_row, st.v_col
        v_row_t.mul_(beta2).add_(row_ms.view(v_row_t.shape), alpha=1 - beta2)
        v_col_t.mul_(beta2).add_(col_ms.view(v_col_t.shape), alpha=1 - beta2)
        v_row = v_row_t.view(batch, rows_here)
        mean = (_exact_sums(v_row, 1, p, cuts_rows, rows) / rows).float()
        if empty:
            return True  # the container counts an empty shard's steps (entry._count_empty_shards)
        mean.clamp_(min=torch.finfo(torch.float32).tiny)

        # As gefen-x's decomposed factored step (_step_automatic_factored), per matrix of the shard.
        bc1 = 1 - beta1 ** step
        bc2 = 1 - beta2 ** fstep
        v_hat = (v_row.view(batch, rows_here, 1) * v_col_t.view(batch, 1, cols_here)).div_(mean.view(batch, 1, 1))
        stepsize = v_hat.div_(bc2).sqrt_().add_(eps).reciprocal_().mul_(1.0 / bc1)
        kernel = cpu_step.factored_momentum(optim)  # the exact CPU kernel's, where it takes the shard
        m = None if kernel is None else kernel(p, grad_view, beta1)
        if m is None:
            m = gx.gefen_momentum_update(optim, p, grad_view, beta1)
        lr = group["lr"]
        lr = float(lr) if torch.is_tensor(lr) else lr
        if group["weight_decay"] > 0.0:
            lp.mul_(1 - lr * group["weight_decay"])
        update = m.view(shape).mul_(stepsize.view(shape)).mul_(lr)
        lp.add_(-update)
        self.taken += 1
        return True
