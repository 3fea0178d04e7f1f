"""Variant: a third optimizer kind, laid out as a built-in one (``gefen_titan/optim/kinds/gefen_muon/``) but
living in the tests, so that adding a kind is shown to touch no package file.

Its optimizer is a Gefen subclass (Gefen's arithmetic and state) with records of its own and a codebook
family of its own in the agreement. Its folder: ``entry`` (its registry entry: ``spec()``), ``options``
(``[optimizer.variant]``), ``keys`` (its rows of the checkpoint format), ``records`` (its record: Gefen's
with a ``kind``), ``description`` (its checkpoint description: Gefen's reader under its names, its own
``convert`` refusal) and ``sharded`` (its state adapter: Gefen's hooks under its names). Registering
``entry.spec()`` with ``gefen_titan.optim.registry.register`` is the one call it needs; the container's
Config then has its table (``GefenOptimizersContainer.config_class()``), the load, the records stage,
``ckpt inspect`` / ``verify`` / ``convert`` and the kinds check know it from its entry.
"""
