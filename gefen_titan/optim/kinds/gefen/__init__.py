"""Gefen: its registry entry (``entry``), options table (``options``), state adapters (``sharded``:
formats v3/v2 under agreed blocking; ``per_rank`` and ``per_rank_regions``: format v1) and its part
of the reshard validation (``validation``). Its records are ``checkpoint.format.gefen_records``."""
