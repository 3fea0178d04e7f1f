"""Fault-tolerant training with torchft: replica groups that heal from a live peer.

torchtitan 0.3.0's ``experiments/torchft`` runs HSDP whose replicate
dimension is torchft's: each replica group is its own torchrun job; when one
dies the others wait (or go on, above ``min_replica_size``), and a restarted
group takes its state from a live group over torchft's transport, with no
checkpoint read. This package makes that work for gefen-titan's optimizers:

- ``manager``: ``GefenTorchFTManager`` (``[fault_tolerance]``): synchronous
  quorum, the managed replicate group in FSDP2's all-reduce hook, a safe
  transport;
- ``transport``: ``SafeHTTPTransport``: heals unpickled with
  ``weights_only=True``;
- ``optimizer``: ``GefenFTOptimizersContainer``: torchft's commit protocol
  around ``GefenOptimizersContainer``, live (never cached) heal state;
- ``heal``: ``HealState``: what a heal carries and how it is checked and loaded;
- ``checkpoint``: ``GefenFTCheckpointManager``: registers the heal, writes
  persistent checkpoints from one group, never for an uncommitted step;
- ``trainer``: ``GefenFaultTolerantTrainer``: retries uncommitted steps.

A recipe turns it on with a ``[fault_tolerance]`` section
(``recipes/llama_gefen_ft.toml``); ``docs/fault_tolerance.md`` has the
commands. torchft is an optional extra: ``pip install 'gefen-titan[ft]'``.
"""
