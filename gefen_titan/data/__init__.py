"""Data: the embedded corpus, datasets, and the two resumable data loaders.

* ``corpus``: the tiny corpus and tokenizer shipped in the package, and the
  ``gefen_tiny`` datasets registered with torchtitan;
* ``indexed`` / ``indexed_build``: pre-tokenized, memory-mapped token
  datasets and their builder;
* ``stream``: the embedded corpus as a multi-file streaming dataset;
* ``elastic``: torchtitan's text loader that resumes at another
  data-parallel size (``on_dp_change``), with ``stream_reshard`` and
  ``loader_state`` for streaming datasets and loader workers;
* ``global_order`` / ``global_loader``: one global sample order that every
  data-parallel size reads in the same batches.
"""
