"""torchtitan's ``TorchFTManager`` with a synchronous quorum and a safe transport.

torchtitan 0.3.0 runs torchft's quorum asynchronously for HSDP (it overlaps
the forward pass). A group that heals in that mode loads its peer's state
only at ``should_commit``, after a forward and backward on its stale
weights whose gradient torchft then zeroes: the step it heals in is the
peers' gradient alone, and the state dict the peer serves is read on
torchft's thread while the peer's main thread is already drawing batches.
Here the quorum is synchronous (``use_async_quorum=False``): the quorum,
the peer's state capture and the joiner's load all happen in ``zero_grad``
before the step's first batch is drawn, on a main thread that waits for
them. The joiner then takes the step with its own batch like every other
group, and what it loaded is the peer's state at one well-defined point.
The cost is one quorum round trip per step that no forward pass hides
(``docs/fault_tolerance.md`` has the figure).

The replicate dimension is still torchft's managed process group, which
FSDP2's all-reduce hook uses (torchtitan sets it up only for the async
quorum). Each group logs the loss of its own share of the batch. A heal travels over
``SafeHTTPTransport``. DiLoCo and LocalSGD (``semi_sync_method``) are
refused: gefen-titan has not made Gefen's state an outer optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed._composable.fsdp.fully_shard import FSDPModule
from torch.distributed.distributed_c10d import ReduceOp
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.experiments.torchft.manager import TorchFTManager

__all__ = ["GefenTorchFTManager"]


class GefenTorchFTManager(TorchFTManager):
    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerance):
        quorum_timeout_s: float = 120.0
        """How long a step waits for a quorum of ``min_replica_size`` groups (a lost group
        restarting counts against it); then the job stops with torchft's error."""

        timeout_s: float = 60.0
        """torchft's timeout for its RPCs and for a heal's transfer."""

        max_retries: int = 20
        """Consecutive uncommitted steps (a lost peer, a failed heal) before the job stops
        with an error instead of retrying; -1: retry forever."""

    def __init__(self, config: Config) -> None:
        if not config.enable:
            self._manager = None
            return
        if config.semi_sync_method is not None:
            raise ValueError(
                f"fault_tolerance.semi_sync_method = {config.semi_sync_method!r}: DiLoCo and LocalSGD are not "
                "supported with gefen-titan's optimizers; leave it unset (synchronous HSDP over replica groups)")
        # Not at the top: torchft is an optional extra (pip install 'gefen-titan[ft]').
        import torchft  # noqa: PLC0415

        from gefen_titan.ft.transport import SafeHTTPTransport  # noqa: PLC0415 (imports torchft)

        timeout = timedelta(seconds=config.timeout_s)
        pg_timeout = timedelta(milliseconds=config.process_group_timeout_ms)
        if config.process_group == "gloo":
            pg = torchft.ProcessGroupGloo(timeout=pg_timeout)
        elif config.process_group == "nccl":
            pg = torchft.ProcessGroupNCCL(timeout=pg_timeout)
        else:
            raise ValueError(f"fault_tolerance.process_group = {config.process_group!r}: use \"gloo\" or \"nccl\"")
        self.use_async_quorum = False
        self.transport = SafeHTTPTransport(timeout=timeout)
        self._manager = torchft.Manager(
            pg=pg,
            min_replica_size=config.min_replica_size,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            replica_id=f"torchtitan_ft_{config.replica_id}",
            checkpoint_transport=self.transport,
            max_retries=None if config.max_retries < 0 else config.max_retries,
        )
        self.group_size = config.group_size
        self.replica_id = config.replica_id
        self.replicate_pg = torchft.process_group.ManagedProcessGroup(self._manager)
        self.replicate_pg.register("dp_replicate")

    def maybe_set_all_reduce_hook(self, model_parts: list[torch.nn.Module]) -> None:
        if not self.enabled:
            return
        replicate_pg = self.replicate_pg

        def all_reduce_hook(output: torch.Tensor) -> None:
            dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)

        hooked = 0
        for part in model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(all_reduce_hook)
                    hooked += 1
        if not hooked:
            # torchtitan averages gradients over replica groups only in FSDP2's hook.
            raise ValueError(
                "fault tolerance needs FSDP2 inside each replica group (gradients are averaged over the groups in "
                "its all-reduce hook), and this model has no FSDP module: run each group on 2 or more ranks with "
                "parallelism.data_parallel_shard_degree = -1 (or > 1)")

    @property
    def loss_sync_pg(self) -> None:
        # torchtitan sums the loss over this group too but divides by the tokens of the replica
        # group only (the logged loss came out twice the loss at 2 groups), and a managed
        # collective in the metrics fails with the peer it lost. Each group logs its own loss.
        return None
