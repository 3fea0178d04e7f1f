"""GefenMuon's sharded step (gefen-titan's own; gefen-x's ``step()`` never runs). Its entry,
options table (``[optimizer.muon]``) and state adapter are ``optim.kinds.gefen_muon``.

* ``step``: ``ShardedMuonStep``, momentum on the shards, Newton-Schulz on every owner at once;
* ``bucket``: one bucket's part of the step (prepare, compute, finish);
* ``step_matrices``: the matrices a rank's step handles, in step order;
* ``stats``: ``MuonStepStats``, what the step measures, and its bound on bytes in flight;
* ``schedule``: the pure plan: buckets and owners, balanced by Newton-Schulz cost;
* ``exchange``: one packed point-to-point exchange per bucket and direction;
* ``matrices``: shard groups, the indices each shard holds, and a parameter's matrices and pieces;
"""

from gefen_titan.optim.muon.matrices import MuonLayoutError, Piece, shard_groups, shard_indices
from gefen_titan.optim.muon.schedule import DEFAULT_BUCKET_MIB, MatrixSpec, Schedule, build_schedule, ns_flops
from gefen_titan.optim.muon.stats import MuonStepStats
from gefen_titan.optim.muon.step import ShardedMuonStep

__all__ = ["DEFAULT_BUCKET_MIB", "MatrixSpec", "MuonLayoutError", "MuonStepStats", "Piece", "Schedule",
           "ShardedMuonStep", "build_schedule", "ns_flops", "shard_groups", "shard_indices"]
