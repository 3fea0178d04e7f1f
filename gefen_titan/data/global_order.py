"""The global sample order: which tokens are sample ``i``, and which sample
sits at each position of the training stream, independent of the DP size.

Why: torchtitan packs tokens per data-parallel rank, so what a global batch
holds depends on how many ranks there are. Here everything is defined on the
one global token stream of an ``IndexedDataset`` before any rank is involved:

* **Packing.** Each document ``BOS t1 ... tn EOS`` contributes the
  (input, label) pairs ``(BOS, t1), (t1, t2), ..., (tn, EOS)``: inputs and
  labels are shifted *within* the document, exactly as torchtitan's
  ``HuggingFaceTextDataset`` does, so no label is the first token of the next
  document. Sample ``i`` is pairs ``[i * seq_len, (i + 1) * seq_len)`` of the
  whole dataset, i.e. the window of ``seq_len + 1`` tokens of each document
  piece it covers. Its ``positions`` restart at 0 at every document start and
  at the sample's first token (torchtitan's convention, which its FlexAttention
  document mask and RoPE read). The last ``num_pairs % seq_len`` pairs are not
  a sample, as torchtitan drops a final partial sample. With ``shuffle =
  false`` at one rank, the samples are torchtitan's, bit for bit.
* **Order.** The training stream is epoch after epoch of the same
  ``samples_per_epoch`` samples; epoch ``e`` visits them in a permutation
  seeded by ``(seed, e)``. Stream position ``k`` is sample
  ``perm_e[k mod samples_per_epoch]`` with ``e = k // samples_per_epoch``.
* **Batches.** Global batch ``b`` is stream positions ``[b * G, (b + 1) * G)``
  for global batch size ``G``, whatever the DP size. How ranks share it is the
  loader's business (``gefen_titan.data.global_loader``); nothing here knows about ranks.

The permutation is a sort by a bijective 64-bit hash of the index
(splitmix64's finalizer), not numpy's random streams, so it is the same on
every numpy version and platform and costs 8 bytes per sample per epoch.
"""

from __future__ import annotations

import bisect

import numpy as np

from gefen_titan.data.indexed import IndexedDataError, IndexedDataset

__all__ = ["GlobalSampleOrder", "epoch_permutation"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int (a bijection of 64-bit values)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (wrapping multiplication)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``(n, seed, epoch)``."""
    key = _mix_int(_mix_int(seed) * _GOLDEN + epoch + 1)
    keys = _mix_array(np.arange(n, dtype=np.uint64) ^ np.uint64(key))
    return np.argsort(keys, kind="stable").astype(np.int64)


class GlobalSampleOrder:
    """Samples of ``seq_len`` (input, label) pairs over ``dataset`` and their
    epoch-shuffled order. Reads touch only the tokens (and offsets) of the
    samples asked for."""

    def __init__(self, dataset: IndexedDataset, seq_len: int, *, seed: int = 0, shuffle: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_pairs = dataset.num_tokens - dataset.num_documents
        self.samples_per_epoch = self.num_pairs // self.seq_len
        if self.samples_per_epoch == 0:
            raise IndexedDataError(
                f"{dataset.path}: {self.num_pairs} (input, label) pairs, fewer than one sample of "
                f"seq_len {self.seq_len}; use a bigger dataset or a shorter training.seq_len"
            )
        self._perms: dict[int, np.ndarray] = {}
        self._offsets = dataset.offsets
        self._tokens = dataset.tokens
        n = dataset.num_documents
        # pair index where document d starts: offsets[d] - d (bisected lazily on the memory map)
        self._doc_keys = range(n)
        self._pair_start = lambda d: int(self._offsets[d]) - d

    # -- the order ---------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.samples_per_epoch, self.seed, epoch)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # keep at most two
            self._perms[epoch] = perm
        return perm

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions ``[start, start + count)``."""
        pos = np.arange(start, start + count, dtype=np.int64)
        if not self.shuffle:
            return pos % self.samples_per_epoch
        epochs, within = np.divmod(pos, self.samples_per_epoch)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self.permutation(int(e))[within[mask]]
        return out

    def epoch_of(self, position: int) -> int:
        return position // self.samples_per_epoch

    # -- the samples -------------------------------------------------------

    def _doc_of_pair(self, p: int, lo: int = 0) -> int:
        """The document holding pair ``p``: the last ``d`` whose first pair is <= p."""
        return bisect.bisect_right(self._doc_keys, p, lo=lo, key=self._pair_start) - 1

    def read(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(inputs, labels, positions)``, int64 arrays of shape ``(len(ids), seq_len)``."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.samples_per_epoch):
            raise IndexError(f"sample ids must lie in [0, {self.samples_per_epoch})")
        S = self.seq_len
        inputs = np.empty((len(ids), S), dtype=np.int64)
        labels = np.empty_like(inputs)
        positions = np.empty_like(inputs)
        pairs = np.arange(S, dtype=np.int64)
        for row, i in enumerate(ids.tolist()):
            a = i * S
            d0 = self._doc_of_pair(a)
            d1 = self._doc_of_pair(a + S - 1, lo=d0)
            offs = np.asarray(self._offsets[d0 : d1 + 2], dtype=np.int64)
            starts = offs[:-1] - np.arange(d0, d1 + 1, dtype=np.int64)  # first pair of each document
            p = a + pairs
            k = np.searchsorted(starts, p, side="right") - 1  # document of each pair, from d0
            lo = a + d0  # token index of pair p in document d is p + d
            toks = np.asarray(self._tokens[lo : a + S - 1 + d1 + 2], dtype=np.int64)
            t = p + k + d0 - lo
            inputs[row] = toks[t]
            labels[row] = toks[t + 1]
            positions[row] = p - np.maximum(starts[k], a)
        return inputs, labels, positions
