"""pp_presplit_step: let pipeline schedules' ``step()`` take pre-split microbatches.

What it fixes
    torchtitan 0.3.0 splits each batch into pipeline microbatches itself and
    calls ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...,
    losses=..., loss_kwargs=..., return_outputs=False)`` (``Trainer
    .pp_forward_backward_step``; ``Validator`` does the same through
    ``eval()``). torch 2.13's ``step()`` only takes a *whole* batch
    (``step(*args, target=None, losses=None, return_outputs=True,
    loss_kwargs=None, **kwargs)``): the three lists fall into ``**kwargs``, are
    treated as model keyword arguments, re-chunked, and handed to the first
    stage's model, so every pipeline-parallel run (any device) fails at step 1::

        TypeError: Decoder.forward() got an unexpected keyword argument 'arg_mbs'

    (raised from ``torch/distributed/pipelining/stage.py`` ``_compute_outputs``
    during the schedule's first metadata inference).

What it does
    Wraps ``step`` of ``PipelineScheduleSingle`` and ``PipelineScheduleMulti``
    (every concrete schedule inherits one of the two). When any of
    ``arg_mbs``/``kwarg_mbs``/``target_mbs`` is passed, the wrapper runs the
    *upstream* ``step`` with no whole-batch inputs, but for that one call makes
    the schedule's ``_step_microbatches`` ignore the (empty) split and use the
    given lists instead. Everything else ``step`` does (the grad-mode check,
    ``has_backward`` on each stage, clearing per-step state, ``losses``,
    merging outputs) is upstream code. Mixing pre-split lists with positional
    inputs, model kwargs or ``target`` raises ``ValueError``, as in the
    upstream API. Without those keywords ``step`` is the original.

Scope
    All devices: CUDA runs hit the same error. It does nothing when ``step``
    already accepts ``arg_mbs`` (a torch with the upstream API).

Upstream status
    torchtitan 0.3.0 expects the pre-split ``step(arg_mbs=, kwarg_mbs=,
    target_mbs=)`` keyword API (pytorch/pytorch PR #188500, "Allow explicit
    pre-split pipeline microbatches"), which torch 2.13.0 does not have; see
    also pytorch/torchtitan PR #4071. torch 2.14 has it (verified on 2.14.1:
    ``UPSTREAM_FROM_TORCH``), so there the patch does nothing. Drop it when
    2.13 leaves ``SUPPORTED_TORCH``.
"""

from __future__ import annotations

import functools
import inspect

from ._util import PatchTargetChanged, is_marked, mark, require_attr, require_params

NAME = "pp_presplit_step"

_PRESPLIT = ("arg_mbs", "kwarg_mbs", "target_mbs")
_STEP_MB_PARAMS = ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs"]


def _classes():
    from torch.distributed.pipelining import schedules

    return (
        require_attr(schedules, "PipelineScheduleSingle"),
        require_attr(schedules, "PipelineScheduleMulti"),
    )


def _wrap(original):
    @functools.wraps(original)
    def step(self, *args, target=None, losses=None, return_outputs=True,
             loss_kwargs=None, **kwargs):
        if not any(k in kwargs for k in _PRESPLIT):
            return original(self, *args, target=target, losses=losses,
                            return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                            **kwargs)
        arg_mbs, kwarg_mbs, target_mbs = (kwargs.pop(k, None) for k in _PRESPLIT)
        if args or kwargs or target is not None:
            raise ValueError(
                "pipeline step(): pre-split microbatches (arg_mbs/kwarg_mbs/"
                "target_mbs) cannot be mixed with positional inputs, model "
                f"kwargs ({sorted(kwargs)}) or target"
            )
        step_microbatches = type(self)._step_microbatches

        def _presplit(_args_split, _kwargs_split, _targets_split, losses_,
                      return_outputs_, loss_kwargs=None):
            return step_microbatches(self, arg_mbs, kwarg_mbs, target_mbs, losses_,
                                     return_outputs_, loss_kwargs=loss_kwargs)

        self._step_microbatches = _presplit  # this call only (instance attribute)
        try:
            return original(self, losses=losses, return_outputs=return_outputs,
                            loss_kwargs=loss_kwargs)
        finally:
            del self._step_microbatches

    return mark(step, original)


def apply() -> bool:
    classes = _classes()
    if all(is_marked(cls.__dict__.get("step")) for cls in classes):
        return True
    for cls in classes:
        step = cls.__dict__.get("step")
        if step is None:
            raise PatchTargetChanged(
                f"gefen_titan.patches.{NAME}: {cls.__name__} no longer defines step()"
            )
        if is_marked(step):
            continue
        params = inspect.signature(step).parameters
        if "arg_mbs" in params:
            return False  # torch has the pre-split API: nothing to do
        for name in ("target", "losses", "return_outputs", "loss_kwargs"):
            if name not in params:
                raise PatchTargetChanged(
                    f"gefen_titan.patches.{NAME}: {cls.__name__}.step() has no "
                    f"{name!r} parameter; re-verify the patch"
                )
        require_params(cls._step_microbatches, _STEP_MB_PARAMS,
                       f"{cls.__name__}._step_microbatches")
        if "loss_kwargs" not in inspect.signature(cls._step_microbatches).parameters:
            raise PatchTargetChanged(
                f"gefen_titan.patches.{NAME}: {cls.__name__}._step_microbatches() "
                "has no 'loss_kwargs' parameter; re-verify the patch"
            )
    for cls in classes:
        if not is_marked(cls.__dict__["step"]):
            cls.step = _wrap(cls.__dict__["step"])
    return True


def is_applied() -> bool:
    return all(is_marked(cls.__dict__.get("step")) for cls in _classes())
