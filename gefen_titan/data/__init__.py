"""Data: the embedded corpus, datasets, and the two resumable data loaders.

This file imports none of the modules (they pull in ``datasets`` and
torchtitan); import the one you need. (``import gefen_titan`` loads the
loaders anyway, through the recipe layer.) Layers, each importing only the
ones above it in this list:

* ``cache``: where data built on first use goes, and the lock that makes a
  host's ranks build it once;
* ``indexed``: pre-tokenized, memory-mapped token datasets (the format);
* ``stream``: local multi-file corpora read as a ``datasets`` stream;
* ``held_out``: the held-out split (which documents training never sees);
* ``corpus``: the tiny corpus and tokenizer shipped in the package, and the
  ``gefen_tiny`` / ``gefen_tiny_stream`` datasets registered with torchtitan
  (and ``gefen_tiny_train`` / ``gefen_tiny_held_out``, the split's sides);
* ``eval_loader``: the validator's loader, one exact pass over a dataset
  with the same number of batches on every rank;
* ``build_inputs``, ``build_encoder``, ``indexed_build``: builds token
  datasets (what a build reads, how it tokenizes, the resumable build; and
  caches one per file);
* ``global_order`` / ``global_loader``: one global sample order that every
  data-parallel size reads in the same batches;
* ``loader_state``, ``stream_reshard``, ``elastic_passes``,
  ``elastic_dataset``, ``elastic``: torchtitan's text loader that resumes at
  another data-parallel size (``on_dp_change``): torchdata's saved loader
  layout, what a stream had not read, which documents and tokens each new
  rank reads, the dataset that reads them, and the loader;
* ``registry``: the loaders a recipe picks by name (``[dataloader] loader``).
"""
