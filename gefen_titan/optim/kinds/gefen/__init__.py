"""Gefen: its registry entry (``entry``), options table (``options``), its rows of the checkpoint format
(``keys``), its records (``records``: v2/v3; ``records_v1``), its checkpoint description (``description``),
what its state costs (``cost``), its state adapters (``sharded``: formats v3/v2 under agreed blocking;
``per_rank``, ``per_rank_plan`` and ``per_rank_regions``: format v1) and its part of the reshard
validation (``validation``)."""
