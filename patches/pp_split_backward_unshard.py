"""pp_split_backward_unshard: zero-bubble pipeline schedules drop the gradient
of a parameter whose FSDP unit was resharded before its backward.

What it fixes
    The zero-bubble schedules (``ZBVZeroBubble``, ``InterleavedZeroBubble``,
    ``DualPipeV``) split each stage's backward into an input-gradient step
    (``backward_one_chunk(full_backward=False)`` ->
    ``_backward.stage_backward_input``) and a later weight-gradient step
    (``backward_weight_one_chunk`` -> ``stage_backward_weight``). The input
    step decides which parameters the weight step will differentiate: it
    takes ``stage.submod.parameters()`` *as registered at that moment* and
    keeps those whose autograd ``AccumulateGrad`` node lies in the stage's
    graph. Under FSDP2 the graph holds the *unsharded* parameters (FSDP2
    reuses one unsharded ``nn.Parameter`` per parameter across all-gathers),
    but a unit that is resharded at that moment registers its *sharded*
    DTensor, whose ``AccumulateGrad`` is no node of the graph. Such a
    parameter is in no param group, the weight step never computes its
    gradient, and nothing says so: it stays ``None``.

    torchtitan 0.3.0 hits this on every pipeline run of a zero-bubble schedule:
    it always applies FSDP2 (a no-op mesh at ``data_parallel_shard_degree``
    1), groups the final ``norm`` with ``lm_head`` in one unit, and its
    ``ChunkedLossWrapper`` (the default loss) ends each microbatch's loss with
    ``lm_head.reshard()``, which reshards that unit, ``norm`` included. So the
    last stage's ``norm.weight`` never gets a gradient: Gefen's agreed blocking
    stops at step 1 (``BlockingError: ... no gradient on the first step
    (norm.weight)``), and under AdamW ``norm.weight`` silently never trains
    (it stays exactly 1.0). ``DualPipeV`` splits only some backwards, so there
    ``norm.weight`` gets part of its gradient and nothing stops (measured:
    step-1 grad norm 0.8586 instead of 0.8602). ``1F1B``/``GPipe``/
    ``Interleaved1F1B`` run one full backward, where autograd itself
    accumulates into the unsharded parameter, and are unaffected.

What it does
    Wraps ``_PipelineStageBase.backward_one_chunk`` (only when
    ``full_backward=False``) and ``backward_weight_one_chunk``: before the
    upstream code runs, it unshards every FSDP module of the stage
    (``FSDPModule.unshard()``, public, a no-op for a unit already unsharded),
    so ``submod.parameters()`` yields the parameters the graph used, for the
    input step's param groups and for the weight step's map from graph nodes
    back to parameters alike. The weight step then accumulates into the
    unsharded parameters' ``.grad``, which FSDP's post-backward reduces into
    the sharded gradients at the schedule's end (``perform_reduce_grad``), as
    for a full backward. The units stay unsharded until then, as they would
    once the upstream input step's own pre-backward hook had run; the
    schedule's final post-backward reshards them.

Scope
    All devices (the bug is not CPU-specific). It does nothing for stages
    without FSDP modules and for full backwards.

Upstream status
    Unfixed in torch 2.13 (``stage_backward_input`` and
    ``stage_backward_weight`` take ``submod.parameters()`` as registered).
    The torchtitan side, the chunked loss resharding the unit that ``norm``
    shares, is what pytorch/torchtitan PR #3229 ("Fix ChunkedCELoss final FSDP
    wrapping": separate ``norm``/``lm_head`` units, no forced reshard) changes;
    not in torchtitan 0.3.0. Drop this patch once neither reshards before a
    split backward (``tests/unit/test_patches.py`` has the contract test).
"""

from __future__ import annotations

import functools

from ._util import is_marked, mark, require_attr, require_params

NAME = "pp_split_backward_unshard"

_BACKWARD_PARAMS = ["self", "bwd_chunk_id", "loss", "full_backward", "last_backward"]
_WEIGHT_PARAMS = ["self", "bwd_chunk_id", "last_backward"]


def _stage_base():
    from torch.distributed.pipelining import stage

    return require_attr(stage, "_PipelineStageBase")


def _unshard_stage(stage) -> None:
    """All-gather every FSDP unit of ``stage`` that is resharded, so that its
    registered parameters are the unsharded ones autograd's graph holds."""
    from torch.distributed.fsdp import FSDPModule

    if not stage.has_backward:
        return
    for module in stage.submod.modules():
        if isinstance(module, FSDPModule):
            module.unshard()


def _wrap_backward(original):
    @functools.wraps(original)
    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        if not full_backward:
            _unshard_stage(self)
        return original(self, bwd_chunk_id, loss=loss, full_backward=full_backward,
                        last_backward=last_backward)

    return mark(backward_one_chunk, original)


def _wrap_weight(original):
    @functools.wraps(original)
    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        _unshard_stage(self)
        return original(self, bwd_chunk_id, last_backward=last_backward)

    return mark(backward_weight_one_chunk, original)


def apply() -> bool:
    cls = _stage_base()
    backward = require_attr(cls, "backward_one_chunk")
    weight = require_attr(cls, "backward_weight_one_chunk")
    if not is_marked(backward):
        require_params(backward, _BACKWARD_PARAMS, "_PipelineStageBase.backward_one_chunk")
        cls.backward_one_chunk = _wrap_backward(backward)
    if not is_marked(weight):
        require_params(weight, _WEIGHT_PARAMS, "_PipelineStageBase.backward_weight_one_chunk")
        cls.backward_weight_one_chunk = _wrap_weight(weight)
    return True


def is_applied() -> bool:
    cls = _stage_base()
    return is_marked(cls.backward_one_chunk) and is_marked(cls.backward_weight_one_chunk)
