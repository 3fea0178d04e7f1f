"""The scale plan's figures of Gefen's factored second moment (``[optimizer.gefen] second_moment =
"factored"``, ``optim.kinds.gefen.factored``): its state per rank, and its per-step collectives against the
gradient traffic.

* **State**: by the kind's rule under the factored option (``StateCost.under``): a code per element, a
  magnitude per block, one fp32 per row and per column of every matrix shard (no ``vmean``, no scratch).
* **Collectives per step**: for every parameter of two dims or more and every mesh dim that cuts its rows
  or its columns (``distributed.layout.placements_cutting``), one int32 exponent and two int64 limbs per
  local row (a cut of the columns) or per local column and per matrix (a cut of the rows), all-reduced in
  two collectives each (MAX, then SUM; ``factored.collective_bytes`` is their payload). Counted as a ring
  all-reduce sends: 2 (n - 1) / n times the payload, per rank.
* **Gradient traffic per step** it is held against: FSDP2's reduce-scatter of the gradient over the
  parameter's data-parallel shard group alone (``Mesh.shard``; an EP-cut expert's: ``shard / ep``), as a
  ring sends it: (n - 1) times the local shard, at 2 bytes per element (a bf16 reduce: the smaller of
  torchtitan's choices, so the ratio errs high). HSDP's replica all-reduce and TP's activations are left
  out, again so that the ratio errs high.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale_parts import Built, Chunks

__all__ = ["GRAD_BYTES", "factored_figures"]

GRAD_BYTES = 2  # bf16 gradient reduce (see the module doc)


def _dp_size(built: Built, p) -> int:
    """The data-parallel shard group of ``p``: FSDP's, or efsdp's for an expert that EP cuts (dim 0)."""
    mesh = built.mesh
    experts = mesh.ep > 1 and len(p.shape) == 3
    return max(1, mesh.shard // mesh.ep) if experts else mesh.shard


def factored_figures(built: Built, state_bytes) -> dict[str, Any]:
    """Per rank (the worst): the factored state, its collective bytes per step and the gradient bytes.

    ``state_bytes(built, name, rule, options=...)`` is the plan's state count (``scale.state_bytes``).
    """
    from gefen_titan.distributed.layout import placements_cutting
    from gefen_titan.optim.kinds.gefen.factored import collective_bytes
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    chunks = Chunks()
    w = built.mesh.world
    sent, grads = [0.0] * w, [0.0] * w
    for p in built.params:
        nd = len(p.shape)
        dp = _dp_size(built, p)
        cut_rows = placements_cutting(p.placements, nd, -2) if nd >= 2 else []
        cut_cols = placements_cutting(p.placements, nd, -1) if nd >= 2 else []
        for r, (sizes, _) in enumerate(chunks.per_rank(p.shape, p)):
            grads[r] += (dp - 1) * math.prod(sizes) * GRAD_BYTES
            for dims, rows, cols in ((cut_cols, False, True), (cut_rows, True, False)):
                for i in dims:
                    n = p.mesh_shape[i]
                    if n > 1:
                        sent[r] += 2 * (n - 1) / n * collective_bytes(sizes, rows, cols)
    state = state_bytes(built, "Gefen", "fallback", options=GefenOptions(second_moment="factored"))
    worst = max(range(w), key=lambda r: sent[r] / grads[r] if grads[r] else 0.0)
    return {"state": max(state), "collective": sent[worst], "grad": grads[worst],
            "ratio": sent[worst] / grads[worst] if grads[worst] else 0.0}
