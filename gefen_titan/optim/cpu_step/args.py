"""The kernel's argument structs (ctypes mirrors of ``kernel.cpp``'s; keep the two in step, and bump
``build.ABI_VERSION`` with ``gt_abi_version()`` when their layout changes) and the scalars torch would use.

torch casts a Python scalar operand to the op's compute type (``opmath``:
float for fp32, bf16 and fp16 tensors, double for fp64), so every
hyperparameter is passed as both, rounded here once, exactly as torch rounds
it (``numpy.float32`` of the Python double).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from gefen_titan.optim.cpu_step.codebook import CodebookTable

__all__ = ["DTYPES", "Codebook", "GefenArgs", "MuonArgs", "f32", "lerp_weight"]

# dtype -> the kernel's code (kernel.cpp ``DType``)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}

_p = ctypes.c_void_p
_i64, _i32 = ctypes.c_int64, ctypes.c_int32
_f, _d = ctypes.c_float, ctypes.c_double


def f32(x: float) -> float:
    """A Python double as torch casts it to float (round to nearest even)."""
    return float(np.float32(x))


class Codebook(ctypes.Structure):
    _fields_ = [("values", _p), ("table", _p), ("fine", _p), ("thresholds", _p), ("n_thresholds", _i32),
                ("nan_code", _i32)]

    @classmethod
    def of(cls, t: CodebookTable) -> Codebook:
        return cls(t.values.data_ptr(), t.table.data_ptr(), t.fine.data_ptr(), t.thresholds.data_ptr(),
                   t.thresholds.numel(), t.nan_code)


def lerp_weight(weight: float) -> dict[str, float | int]:
    """torch's ``lerp`` scalar weight: as float and double, 1 - weight in each, and its branch (|w| < 0.5)."""
    w = f32(weight)
    return {"w_f": w, "omw_f": float(np.float32(1.0) - np.float32(w)), "w_d": weight, "omw_d": 1.0 - weight,
            "w_small": int(abs(w) < 0.5)}


class GefenArgs(ctypes.Structure):
    _fields_ = [
        ("p", _p), ("g", _p), ("codes", _p), ("magnitude", _p), ("vmean", _p), ("sqrt_vmean", _p),
        ("blocks", _i64), ("period", _i64),
        ("dtype", _i32), ("sum_width", _i32), ("sum_width_f64", _i32), ("fused", _i32),
        ("cb", Codebook),
        ("w_f", _f), ("omw_f", _f), ("w_d", _d), ("omw_d", _d), ("w_small", _i32),
        ("beta2_f", _f), ("alpha_f", _f),
        ("alpha_d", _d),
        ("sqrt_bc2_f", _f), ("eps_f", _f), ("inv_bc1_f", _f),
        ("lr_f", _f), ("wdf_f", _f), ("lr_d", _d), ("wdf_d", _d), ("has_wd", _i32),
        ("out", _p),  # gt_gefen_momentum's dense momentum (the block step leaves it null)
    ]


class MuonArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("g", _p), ("codes", _p), ("magnitude", _p),
        ("blocks", _i64), ("period", _i64),
        ("dtype", _i32), ("fused", _i32),
        ("cb", Codebook),
        ("w_f", _f), ("omw_f", _f), ("w_d", _d), ("omw_d", _d), ("w_small", _i32),
        ("tiny_f", _f),
        ("nesterov", _i32),
        ("mom_f", _f), ("alpha_f", _f), ("mom_d", _d), ("alpha_d", _d),
    ]
