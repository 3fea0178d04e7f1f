"""The checkpoint format: what is on disk and how it decodes (the bottom wing of ``checkpoint``).

Keys and records (``schema``, ``schema_records``, ``schema_doc`` for the key
tables of ``docs/checkpoint_format.md``), each optimizer kind's description
of its state (``kinds``), the ``.digests`` file (``digests``, ``digest_keys``),
the pickles read without running code (``unpickling``, ``pickle_budget``) and
``files``, through which every file of a checkpoint is opened against a bound.
No module here reads a checkpoint for a load: ``checkpoint.io`` does, with
``checkpoint.checks``.
"""
