"""What a load checks of what it reads, before anything reaches a live tensor (the middle wing).

``load_checks`` is the one list of checks, run by the load and by the offline
tools alike; ``metadata_fields`` (``.metadata``'s types), ``metadata_checks``
(``.metadata`` against the files' sizes), ``record_checks``
(every kind's records, without a live model) and ``entry_values`` (the byte
entries torchtitan's components save) are its stages. They read through
``checkpoint.format`` only; ``checkpoint.io`` calls them.
"""
