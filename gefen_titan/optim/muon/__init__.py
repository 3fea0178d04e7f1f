"""GefenMuon's sharded step (gefen-titan's own; gefen-x's ``step()`` never runs). Its entry,
options table (``[optimizer.muon]``) and state adapter are ``optim.kinds.gefen_muon``.

* ``step``: ``ShardedMuonStep``, momentum on the shards, Newton-Schulz on every owner at once;
* ``schedule``: the pure plan: buckets and owners, balanced by Newton-Schulz cost;
* ``exchange``: one packed point-to-point exchange per bucket and direction;
* ``layout``: shard groups and the indices each shard holds;
"""

from gefen_titan.optim.muon.matrices import MuonLayoutError, Piece, shard_groups, shard_indices
from gefen_titan.optim.muon.schedule import DEFAULT_BUCKET_MIB, MatrixSpec, Schedule, build_schedule, ns_flops
from gefen_titan.optim.muon.step import MuonStepStats, ShardedMuonStep

__all__ = ["DEFAULT_BUCKET_MIB", "MatrixSpec", "MuonLayoutError", "MuonStepStats", "Piece", "Schedule",
           "ShardedMuonStep", "build_schedule", "ns_flops", "shard_groups", "shard_indices"]
