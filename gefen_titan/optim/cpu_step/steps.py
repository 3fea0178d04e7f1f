"""The per-parameter steps the kernel takes, and when it hands one back to gefen-x.

``GefenStep(group, p, grad)`` is Gefen's whole step of one parameter on the
CPU (gefen-x's ``_step_automatic`` after the parameter's first step: the
vmean update, the step counters, weight decay, the stepsize, the momentum
update and the apply); ``MuonMomentum(group, p, grad)`` is GefenMuon's
momentum update (``_prepare_muon_momentum``: dequantize, lerp, requantize,
count, the Nesterov blend), returning the dense momentum for Newton-Schulz. ``GefenMomentum(p, grad, beta1)``
is Gefen's momentum update alone (gefen-x's ``_automatic_momentum_update_merged``),
for the factored second moment's step (``optim.kinds.gefen.factored``), which
takes the rest itself; it returns the dense requantized momentum.
``gefenx.route_cpu_step`` offers each parameter to the first two; the factored
step calls the third (``cpu_step.factored_momentum``). They decline
(False / None, and gefen-x's own code runs) where gefen-x would do something
the kernel does not: the parameter's first step (it allocates the state,
and may search the period and learn the codebook), a CUDA or non-contiguous
tensor, a dtype other than fp32/bf16/fp16/fp64, and the two ops whose
rounding torch makes depend on the thread count: a single block row of
32768+ elements summed on several threads (the vmean's sum: ``GefenMomentum``,
which sums no row, takes it), and GefenMuon's Nesterov blend on
bf16/fp16 gradients. Each decline is counted by reason
(``declined``), so a run can tell which path its parameters took.

The step runs once per parameter per training step, so what does not change
between steps (the state tensors' addresses, the codebook's table, the
hyperparameters' roundings) is prepared once and checked by identity.
"""

from __future__ import annotations

import ctypes
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.distributed import local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.cpu_step.args import DTYPES, Codebook, GefenArgs, MuonArgs, f32, lerp_weight
from gefen_titan.optim.cpu_step.build import Library
from gefen_titan.optim.cpu_step.codebook import CodebookTable, table_for

__all__ = ["GRAIN_SIZE", "GefenMomentum", "GefenStep", "MuonMomentum", "VMEAN_CHUNK", "splits_across_threads"]

# at::internal::GRAIN_SIZE: above it torch reduces a lone output row in per-thread pieces.
GRAIN_SIZE = 32768
# gefen-x's GEFEN_MOMENTUM_UPDATE_CHUNK: its vmean update calls torch.mean on row chunks of this many elements.
VMEAN_CHUNK = 1 << 23


def splits_across_threads(blocks: int, period: int, threads: int) -> bool:
    """Whether gefen-x's vmean update makes torch sum a lone row across threads (an order that depends on
    the thread count, which the kernel does not follow): a row chunk of one row of GRAIN_SIZE+ elements."""
    if threads <= 1 or period < GRAIN_SIZE:
        return False
    rows = max(1, VMEAN_CHUNK // period)
    return blocks == 1 or rows == 1 or (blocks > rows and blocks % rows == 1)


def _plain_cpu(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"


@dataclass
class _Prepared:
    """One parameter's kernel arguments that hold while its state tensors and the codebook do."""

    args: Any  # GefenArgs | MuonArgs
    state: tuple[torch.Tensor, ...]  # the state tensors the args point into (checked by identity)
    codebook: torch.Tensor
    table: CodebookTable  # kept alive: the args point into it
    dtype: torch.dtype
    numel: int
    threads: int
    root: torch.Tensor | None = None  # Gefen: torch.sqrt(vmean)'s output


class _Step:
    # Whether the kernel sums each block row as torch does (Gefen's vmean): then a lone row that torch would
    # sum across threads is declined. A row's max |.| (the magnitude) is the same at any split: torch's
    # max(dim) keeps the first NaN by its index.
    sums_rows = True

    def __init__(self, optim: Optimizer, lib: Library) -> None:
        self.optim = optim
        self.lib = lib
        self.taken = 0
        self.declined: Counter[str] = Counter()
        self._err = ctypes.create_string_buffer(512)
        self._prepared: dict[int, _Prepared] = {}
        self._hyper: tuple[tuple, dict[str, Any]] = ((), {})  # one slot: the LR schedule changes lr every step

    def _call(self, fn: Any, args: ctypes.Structure) -> None:
        if fn(ctypes.byref(args), self._err, len(self._err)) != 0:
            raise RuntimeError(f"gefen-titan CPU step kernel failed: {self._err.value.decode(errors='replace')}")

    def _decline(self, why: str) -> None:
        self.declined[why] += 1

    def _prepared_for(self, p: torch.Tensor, g: torch.Tensor, period: int, state: tuple[torch.Tensor, ...],
                      new_args: type) -> _Prepared | str:
        """The parameter's prepared arguments (rebuilt when its state tensors, the codebook, the dtype or the
        thread count changed), or why the kernel cannot take it."""
        codebook = gx.codebook(self.optim)
        threads = torch.get_num_threads()
        prep = self._prepared.get(id(p))
        if (prep is not None and prep.codebook is codebook and prep.dtype is g.dtype and prep.numel == g.numel()
                and prep.threads == threads and all(a is b for a, b in zip(prep.state, state))):
            return prep
        if codebook is None:
            return "no codebook"
        if g.dtype not in DTYPES:
            return f"dtype {g.dtype}"
        n = g.numel()
        if n == 0:
            return "empty shard"
        if not period or n % period:
            return "period"
        blocks = n // period
        shapes = [(blocks, period)] + [(blocks, 1)] * (len(state) - 1)
        if not all(_plain_cpu(t) and t.is_contiguous() and tuple(t.shape) == s for t, s in zip(state, shapes)):
            return "state not on the CPU, or not gefen-x's layout"
        if self.sums_rows and splits_across_threads(blocks, period, threads):
            return "a lone row that torch sums across threads"
        table = table_for(codebook, g.dtype)
        args = new_args(codes=state[0].data_ptr(), magnitude=state[1].data_ptr(), blocks=blocks, period=period,
                        dtype=DTYPES[g.dtype], cb=Codebook.of(table))
        prep = _Prepared(args=args, state=state, codebook=codebook, table=table, dtype=g.dtype, numel=n,
                         threads=threads)
        self._prepared[id(p)] = prep
        return prep

    def _take(self, p: torch.Tensor, operand: torch.Tensor, grad: torch.Tensor,
              state: tuple[int, tuple[torch.Tensor, ...]] | None,
              new_args: type) -> tuple[_Prepared, tuple[torch.Tensor, torch.Tensor]] | None:
        """(prepared arguments, (flat ``operand``, flat gradient)) for a parameter whose ``state`` is (its block
        period, its state tensors), or None after noting why the kernel does not take it (no state yet:
        its first step, or an empty shard)."""
        if state is None:
            self._decline("no state yet (its first step, or an empty shard)")
            return None
        ops = self._operands(operand, grad)
        prep = ops if isinstance(ops, str) else self._prepared_for(p, ops[1], state[0], state[1], new_args)
        if isinstance(prep, str):
            self._decline(prep)
            return None
        return prep, ops

    @staticmethod
    def _operands(p: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | str:
        """(flat local parameter, flat contiguous local gradient), or why the kernel cannot take them."""
        g, pl = local(grad), local(p)
        if not (_plain_cpu(g) and _plain_cpu(pl)):
            return "not a plain CPU tensor"
        if pl.dtype != g.dtype or pl.numel() != g.numel():
            return f"parameter {pl.dtype} {pl.numel()} / gradient {g.dtype} {g.numel()}"
        if not pl.is_contiguous():
            return "non-contiguous parameter"
        return pl.view(-1), g.reshape(-1).contiguous()


class GefenMomentum(_Step):
    """Gefen's quantized momentum update of one parameter's shard alone (``gefenx.gefen_momentum_update``): the
    codes and magnitudes updated in place and the dense requantized momentum returned ([blocks, period]: fp32,
    fp64 for fp64 gradients, as gefen-x's), or None where gefen-x's must run. For the factored second
    moment's step, which counts the steps and takes the stepsize and the apply itself."""

    sums_rows = False

    def __call__(self, p: torch.Tensor, grad: torch.Tensor, beta1: float) -> torch.Tensor | None:
        st = gx.gefen_read(self.optim, p)
        state = None if st is None else (st.period, (st.codes, st.magnitude))
        grad = local(grad).contiguous()  # read only: a non-contiguous view is taken through a copy
        taken = self._take(p, grad, grad, state, GefenArgs)
        if taken is None:
            return None
        prep, (_, g) = taken
        out = torch.empty(st.codes.shape, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)
        a = prep.args
        a.out, a.g, a.fused = out.data_ptr(), g.data_ptr(), int(self.lib.fused)
        beta1 = float(beta1)
        if self._hyper[0] != (beta1,):
            self._hyper = ((beta1,), lerp_weight(1 - beta1))
        for name, value in self._hyper[1].items():
            setattr(a, name, value)
        self._call(self.lib.lib.gt_gefen_momentum, a)
        self.taken += 1
        return out


class GefenStep(_Step):
    """Gefen's step of one parameter (True), or False where gefen-x's own must run; ``momentum``: its
    momentum update alone, for the factored second moment's step."""

    def __init__(self, optim: Optimizer, lib: Library) -> None:
        super().__init__(optim, lib)
        self.momentum = GefenMomentum(optim, lib)

    def __call__(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        st = gx.gefen_read(self.optim, p)
        state = None if st is None else (st.period, (st.codes, st.magnitude, st.vmean))
        taken = self._take(p, p, grad, state, GefenArgs)
        if taken is None:
            return False
        prep, (pl, g) = taken
        a = prep.args
        if prep.root is None:
            a.vmean = st.vmean.data_ptr()
            a.sum_width, a.sum_width_f64, a.fused = self.lib.sum_width, self.lib.sum_width_f64, int(self.lib.fused)
            prep.root = torch.empty_like(st.vmean)
            a.sqrt_vmean = prep.root.data_ptr()
        a.p, a.g = pl.data_ptr(), g.data_ptr()
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
        beta1, beta2 = float(group["beta1"]), float(group["beta2"])
        wd = float(group["weight_decay"])
        key = (lr, beta1, beta2, float(group["eps"]), wd)
        hyper = self._hyper[1] if self._hyper[0] == key else None
        if hyper is None:
            # ctypes rounds a float field as torch rounds a scalar operand (to nearest); lerp_weight's
            # 1 - w and the fp32 alpha are worked in float here, as torch works them.
            wdf = 1 - lr * wd
            hyper = dict(**lerp_weight(1 - beta1), beta2_f=beta2, alpha_f=1 - beta2, alpha_d=1 - beta2,
                         eps_f=key[3], lr_f=lr, wdf_f=wdf, lr_d=lr, wdf_d=wdf, has_wd=int(wd > 0.0))
            self._hyper = (key, hyper)
        for name, value in hyper.items():
            setattr(a, name, value)
        step, vmean_step = st.step + 1, st.vmean_step + 1
        bc1, bc2 = 1 - beta1**step, 1 - beta2**vmean_step
        a.sqrt_bc2_f, a.inv_bc1_f = math.sqrt(bc2), 1.0 / bc1
        self._call(self.lib.lib.gt_gefen_moments, a)
        # torch.sqrt, as gefen-x takes it: on x86 builds it is MKL's vsSqrt, not always correctly rounded
        torch.sqrt(st.vmean, out=prep.root)
        self._call(self.lib.lib.gt_gefen_apply, a)
        gx.gefen_set_empty_shard_counters(self.optim, p, step, vmean_step)
        self.taken += 1
        return True


class MuonMomentum(_Step):
    """GefenMuon's momentum update of one parameter's shard: the dense momentum, or None where gefen-x's must run."""

    def __call__(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        st = gx.muon_read(self.optim, p)
        state = None if st is None else (st.period, (st.codes, st.magnitude))
        taken = self._take(p, grad, grad, state, MuonArgs)
        if taken is None:
            return None
        prep, (_, g) = taken
        if group["nesterov"] and g.dtype in (torch.bfloat16, torch.float16):
            # torch's add_(g, alpha) on these dtypes rounds in float in its vector loop and in the dtype in
            # its scalar tail, whose place depends on the thread count: gefen-x's own bits cannot be followed
            self._decline("bf16/fp16 Nesterov blend")
            return None
        momentum = float(group["momentum"])
        out = torch.empty(g.shape, dtype=g.dtype)
        a = prep.args
        a.out, a.g, a.fused = out.data_ptr(), g.data_ptr(), int(self.lib.fused)
        for name, value in lerp_weight(1 - momentum).items():
            setattr(a, name, value)
        a.tiny_f = f32(torch.finfo(g.dtype).tiny)
        a.nesterov = int(bool(group["nesterov"]))
        a.mom_f, a.alpha_f, a.mom_d, a.alpha_d = momentum, 1 - momentum, momentum, 1 - momentum
        self._call(self.lib.lib.gt_muon_momentum, a)
        gx.muon_write(self.optim, p, gx.MuonState(period=st.period, step=st.step + 1, codes=st.codes,
                                                  magnitude=st.magnitude, rows=st.rows, rows_step=st.rows_step))
        self.taken += 1
        return out.view_as(local(grad))
