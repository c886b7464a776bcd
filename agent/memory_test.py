"""The self-test's memory check (agent/selftest.py): a pattern test over a share of a device's free
memory, as memtest-style tools run on HBM. Every pattern is written over the whole region before any
of it is read back, so a cell that loses its charge, or is disturbed by its neighbours' writes, has
the whole pass to show it:
- all zeros, all ones, and the two alternating-bit checkerboards (0x55…, 0xAA…): stuck bits and
  coupling between adjacent bits;
- each 64-bit word's own index: an address line that maps two words to one cell, which every
  uniform pattern reads back as written.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel

CHUNK_BYTES = 256 << 20  # one allocation; its comparison's temporaries are a fraction of it
# int64 words: zeros, ones, 0x5555…, 0xAAAA… (as signed 64-bit values).
PATTERNS = (0, -1, 0x5555_5555_5555_5555, -0x5555_5555_5555_5556)


class MemoryCheck(BaseModel):
    passed: bool
    detail: str
    tested_bytes: int


def free_bytes(device: torch.device) -> int:
    """What the device has free now (a CUDA device; the self-test runs with the node vacated)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def memory_pattern(device: torch.device, size: int, corrupt: bool = False) -> MemoryCheck:
    """Write and read back every pattern over `size` bytes of `device` (one chunk of it left for the
    index pattern's reference). `corrupt`: one bit of one word reads back flipped, as a stuck cell would."""
    reference = min(CHUNK_BYTES, size // 2)  # left free for the index pattern's reference, a chunk at a time
    words, chunk = max(1, (size - reference) // 8), CHUNK_BYTES // 8
    firsts = range(0, words, chunk)  # each chunk's first word
    chunks = [torch.empty(min(chunk, words - first), dtype=torch.int64, device=device) for first in firsts]
    wrong = 0
    for number, pattern in enumerate(PATTERNS):
        for tensor in chunks:
            tensor.fill_(pattern)
        if corrupt and number == 0:
            chunks[-1][-1:].bitwise_xor_(1 << 17)
        wrong += sum(int(tensor.ne(pattern).sum()) for tensor in chunks)
    for first, tensor in zip(firsts, chunks, strict=True):
        torch.arange(first, first + tensor.numel(), out=tensor)
    for first, tensor in zip(firsts, chunks, strict=True):
        wrong += int(tensor.ne(torch.arange(first, first + tensor.numel(), device=device)).sum())
    tested = words * 8
    amount = f"{tested / (1 << 30):.2f} GiB" if tested >= 1 << 30 else f"{tested / (1 << 20):.1f} MiB"
    where = f"{len(PATTERNS) + 1} patterns over {amount} of {device}"
    del chunks
    if wrong:
        detail = f"memory: {wrong} of {words} words read back wrong ({where})"
        return MemoryCheck(passed=False, detail=detail, tested_bytes=tested)
    return MemoryCheck(passed=True, detail=f"memory: {where}, every word read back as written", tested_bytes=tested)
