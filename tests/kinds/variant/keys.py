"""Variant's rows of the checkpoint format: its records and its codebook under segments of its own; its
parameters' tensors are Gefen's (``qcodes``, ``grid``), which Gefen's rows already define."""

from __future__ import annotations

from gefen_titan.checkpoint.format.schema import KeyRow

RECORD_KIND, CODEBOOK_KIND = "variant", "variant_codebook"
ROWS = (KeyRow(RECORD_KIND, "gefen/variant/{opt}", small="str"),
        KeyRow(CODEBOOK_KIND, "gefen/variant_codebook/{opt}", small="tensor"))
