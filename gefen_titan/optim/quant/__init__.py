"""Gefen's quantize arithmetic outside gefen-x: dequantize, re-block and requantize.

Used where a Gefen state must change its blocks: a per-rank (format v1)
load at another layout (``optim.kinds.gefen.per_rank``) and ``gefen-titan
ckpt convert`` (to and from AdamW's moments). ``requant`` holds the
reference (torch) arithmetic, ``kernels`` its fused Triton kernels (bit-equal,
``docs/kernels.md``), ``segments`` the description both take of a shard's
source blocks.
"""
