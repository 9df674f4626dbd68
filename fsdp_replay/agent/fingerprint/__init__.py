"""Tensor fingerprints computed where the data is.

- CPU tensors: ``sk64`` = the row sums and column sums of the bytes read as int64 words in rows
  of 32 (256 bytes), reduced to 64 bits by a crc32 of those sums and their total. The native
  core (``native.py``, ``_fpcore.c``) computes it in one pass for every contiguous CPU tensor,
  and the parameters of a step in one call. Without it, torch computes the same value with three
  reductions, and tensors under 64 KiB get ``zlib64`` instead (crc32 of the bytes combined with
  their wrapping int64 sum: fewer calls, which is what costs at those sizes).
- CUDA tensors: ``sk64`` where the bytes are whole rows (three reductions on the tensor's own
  stream), else ``lin64`` = three wrapping int64 sums of the int32 words (plain, weighted by
  column and by row of a 1024-wide layout); the parameters of a step take batched lin64. Nothing
  is synchronised: the sums are copied to pinned host memory behind a CUDA event, and the
  agent's writer thread reads them later (``Pending``).

All change for every single-bit change and for a swap of two unequal elements (a plain sum
misses swaps; ``torch.hash_tensor`` is an xor-reduce and misses them too). The numpy reference
in ``fsdp_replay.trace.fingerprint`` computes the same values from raw bytes.
"""

from fsdp_replay.agent.fingerprint.many import fingerprint_many
from fsdp_replay.agent.fingerprint.pending import Pending, host_buffer, host_values, nbytes_of
from fsdp_replay.agent.fingerprint.regions import fingerprint_with_region, region_of
from fsdp_replay.agent.fingerprint.tensor import default_algo, fingerprint

__all__ = [
    "Pending",
    "default_algo",
    "fingerprint",
    "fingerprint_many",
    "fingerprint_with_region",
    "host_buffer",
    "host_values",
    "nbytes_of",
    "region_of",
]
