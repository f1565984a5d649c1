"""PyTorch's CUDA caching allocator, replayed: what ``torch.cuda.max_memory_reserved`` reports for a
sequence of allocations and frees, beside what ``max_memory_allocated`` reports.

The rules are c10/cuda/CUDACachingAllocator.cpp's (PyTorch 2.x, default ``PYTORCH_CUDA_ALLOC_CONF``:
no ``max_split_size_mb``, no expandable segments, one stream):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; ``round_size``);
- requests of at most 1 MiB (``kSmallSize``) are served from the small pool, the rest from the large;
- a request takes the smallest free cached block of its pool that holds it (``get_free_block``: the
  pool is a set ordered by size, then address; ``lower_bound``);
- if none does, a new segment is ``cudaMalloc``-ed (``get_allocation_size``): 2 MiB for a small request
  (``kSmallBuffer``), 20 MiB for one under 10 MiB (``kLargeBuffer``, ``kMinLargeAlloc``), else the
  request rounded up to 2 MiB (``kRoundLarge``);
- the block is split, the request taking its low addresses, where what remains is at least 512 bytes
  (small pool) or more than 1 MiB (large pool) (``should_split``); the remainder stays cached;
- a freed block merges with free neighbours of its segment (``free_block``, ``try_merge_blocks``);
- where ``cudaMalloc`` would pass the device's memory, every cached segment that is wholly free is
  released first and the request retried (``release_cached_blocks``), as the allocator does before an
  out-of-memory error.

Reserved is the sum of the segments held; allocated the sum of the blocks in use (rounded sizes, as the
allocator counts them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: the largest request served from the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
LARGE_ROUNDING_BYTES = 2 << 20  # kRoundLarge
SEGMENT_GAP_BYTES = 1 << 40  # segments never touch: blocks of two segments never merge


def rounded_bytes(nbytes: int) -> int:
    """``round_size``: what a request of ``nbytes`` takes from a block."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_bytes(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc``-ed for a rounded request no cached block holds."""
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES


@dataclass
class _Block:
    address: int
    size: int
    segment: int
    in_use: bool = False


@dataclass
class CachingAllocator:
    """One device's allocator state. ``capacity_bytes``: the device's memory (0: unbounded)."""
    capacity_bytes: int = 0
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    releases: int = 0  # times the cached segments were released to make room (num_alloc_retries)
    _free: dict = field(default_factory=lambda: {True: [], False: []})  # small? -> sorted [(size, address)]
    _at: dict = field(default_factory=dict)  # address -> block
    _ending_at: dict = field(default_factory=dict)  # end address -> block
    _segments: dict = field(default_factory=dict)  # base address -> (base address, bytes, small pool?)
    _next_base: int = 0

    def malloc(self, nbytes: int) -> int:
        """The address of a block for ``nbytes``."""
        size = rounded_bytes(nbytes)
        small = size <= SMALL_REQUEST_BYTES
        block = self._take_free(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES:
            self._forget(block)
            rest = _Block(block.address + size, remaining, block.segment)
            block.size = size
            self._index(block)
            self._index(rest)
            self._cache(rest, small)
        block.in_use = True
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.address

    def free(self, address: int) -> None:
        block = self._at[address]
        block.in_use = False
        self.allocated_bytes -= block.size
        small = self._segments[block.segment][2]  # the pool its segment was made for
        for neighbour in (self._ending_at.get(block.address), self._at.get(block.address + block.size)):
            if neighbour is not None and not neighbour.in_use and neighbour.segment == block.segment:
                self._uncache(neighbour, small)
                self._forget(neighbour)
                self._forget(block)
                block.address = min(block.address, neighbour.address)
                block.size += neighbour.size
                self._index(block)
        self._cache(block, small)

    def reset_peaks(self) -> None:
        self.peak_reserved_bytes, self.peak_allocated_bytes = self.reserved_bytes, self.allocated_bytes

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, address = pool.pop(i)
        return self._at[address]

    def _new_segment(self, size: int, small: bool) -> _Block:
        nbytes = segment_bytes(size)
        if self.capacity_bytes and self.reserved_bytes + nbytes > self.capacity_bytes:
            self._release_cached()
        segment = base = self._next_base
        self._next_base += SEGMENT_GAP_BYTES
        self._segments[segment] = (base, nbytes, small)
        block = _Block(base, nbytes, segment)
        self._index(block)
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _release_cached(self) -> None:
        """``release_cached_blocks``: every segment whose one block is free goes back to the device."""
        self.releases += 1
        for small in (True, False):
            kept = []
            for size, address in self._free[small]:
                block = self._at[address]
                base, nbytes, _ = self._segments[block.segment]
                if block.address == base and block.size == nbytes:
                    self._forget(block)
                    del self._segments[block.segment]
                    self.reserved_bytes -= nbytes
                else:
                    kept.append((size, address))
            self._free[small] = kept

    def _cache(self, block: _Block, small: bool) -> None:
        bisect.insort(self._free[small], (block.size, block.address))

    def _uncache(self, block: _Block, small: bool) -> None:
        pool = self._free[small]
        pool.pop(bisect.bisect_left(pool, (block.size, block.address)))

    def _index(self, block: _Block) -> None:
        self._at[block.address] = block
        self._ending_at[block.address + block.size] = block

    def _forget(self, block: _Block) -> None:
        del self._at[block.address]
        del self._ending_at[block.address + block.size]
