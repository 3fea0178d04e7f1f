"""DCP storage readers and writers (the top wing of ``checkpoint``).

``reading`` and ``item_reads``: readers that check ``.digests`` and the load's
checks (``checkpoint.checks``) before any byte is used, and read v3's raw
entries; ``writing``: writers of the raw entries and of ``.digests``;
``storage``: the one place that opens either, for local folders and fsspec
URLs alike.
"""
