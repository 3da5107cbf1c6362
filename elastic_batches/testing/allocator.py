"""A model of CUDA's caching allocator (and of its ``expandable_segments`` mode), in bytes, for ``MemoryBudget``.

The rules are those of PyTorch's ``CUDACachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``):

* every request is rounded up to a multiple of 512 bytes;
* requests of at most 1 MiB come from the *small* pool, whose segments are 2 MiB; larger
  requests come from the *large* pool, whose segments are 20 MiB for requests under 10 MiB and
  the request rounded up to 2 MiB otherwise;
* a request takes the smallest cached free block of its pool that is large enough (best fit),
  split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool); freed
  blocks stay cached (reserved) and merge with free neighbours of their segment;
* when no cached block fits and a new segment would pass the limit, the cached segments that
  hold no live block are released and the new segment is tried again; only then is it an OOM.

``allocator="expandable"`` models ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: each
pool maps pages into one growing address range (2 MiB pages in the small pool, 20 MiB pages in
the large one, the sizes its ``ExpandableSegment`` maps), so free neighbours merge across what
would have been separate segments and memory is given back page by page: an OOM happens only
when the pages the live blocks touch plus the pages a request needs pass the limit.
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = ["ALLOCATORS", "Block", "CachingAllocator"]

ALLOCATORS = ("exact", "caching", "expandable")

_MIN_BLOCK = 512  # every request is rounded up to a multiple of this
_SMALL_SIZE = 1 << 20  # requests up to this come from the small pool
_SMALL_BUFFER = 2 << 20  # the small pool's segment size
_LARGE_BUFFER = 20 << 20  # the large pool's segment size for requests under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20  # larger requests' segments are rounded up to this


def round_size(nbytes: int) -> int:
    """A request of ``nbytes`` as the allocator rounds it (a multiple of 512 bytes, at least 512).

    Example:
        >>> from elastic_batches.testing.allocator import round_size
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)


def segment_size(size: int) -> int:
    """The size of the segment a new ``size``-byte (rounded) request makes the allocator reserve.

    Example:
        >>> from elastic_batches.testing.allocator import segment_size
        >>> [segment_size(n) >> 20 for n in (4096, 2 << 20, 11 << 20)]
        [2, 20, 12]
    """
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


@dataclasses.dataclass(eq=False)
class Block:
    """A range of one segment: ``size`` bytes at ``offset``, live (``allocated``) or cached free."""

    segment: _Segment
    offset: int
    size: int
    allocated: bool = False


@dataclasses.dataclass(eq=False)
class _Segment:
    small: bool
    size: int
    blocks: list[Block] = dataclasses.field(default_factory=list)  # by offset, covering the segment


def _page_size(small: bool) -> int:
    """The pages an expandable segment maps: 2 MiB in the small pool, 20 MiB in the large one."""
    return _SMALL_BUFFER if small else _LARGE_BUFFER


def _pages(offset: int, size: int, small: bool) -> range:
    """The pages a range of a pool's expandable segment touches."""
    page = _page_size(small)
    return range(offset // page, -(-(offset + size) // page))


class CachingAllocator:
    """Segments, blocks and the bytes reserved and allocated, as CUDA's caching allocator keeps them.

    Args:
        expandable: Model ``expandable_segments:True`` (one growing segment per pool).

    Example:
        >>> from elastic_batches.testing.allocator import CachingAllocator
        >>> allocator = CachingAllocator()
        >>> block = allocator.malloc(3 << 20, limit=None)  # a 3 MiB request reserves a 20 MiB segment
        >>> allocator.allocated_bytes >> 20, allocator.reserved_bytes >> 20
        (3, 20)
        >>> allocator.free(block)
        >>> allocator.allocated_bytes, allocator.reserved_bytes >> 20, allocator.empty_cache() >> 20
        (0, 20, 20)
    """

    def __init__(self, *, expandable: bool = False) -> None:
        self.expandable = expandable
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self._segments: list[_Segment] = []
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}  # by pool: (size, id, block)
        self._pools: dict[bool, _Segment] = {}  # expandable: the one segment of each pool
        self._mapped: dict[bool, set[int]] = {True: set(), False: set()}  # expandable: the pages mapped per pool

    # --- the free lists -------------------------------------------------------------------------------------
    def _cache(self, block: Block) -> None:
        bisect.insort(self._free[block.segment.small], (block.size, id(block), block))

    def _uncache(self, block: Block) -> None:
        free = self._free[block.segment.small]
        index = bisect.bisect_left(free, (block.size, id(block)))
        del free[index]

    def _best_fit(self, size: int, small: bool) -> Block | None:
        free = self._free[small]
        index = bisect.bisect_left(free, (size,))
        return free[index][2] if index < len(free) else None

    # --- allocation -----------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, *, limit: int | None) -> Block | None:
        """A live block for a request of ``nbytes``, or ``None`` when it would pass ``limit`` reserved bytes.

        Before giving up, the cached segments (pages, when expandable) that hold no live block
        are released and the request is tried again, as the allocator does before it raises.
        """
        size = round_size(nbytes)
        small = size <= _SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            block = self._grow(size, small, limit)
            if block is None:
                self.empty_cache()
                block = self._best_fit(size, small) or self._grow(size, small, limit)
                if block is None:
                    return None
        self._uncache(block)
        rest = block.size - size
        if rest >= _MIN_BLOCK if small else rest > _SMALL_SIZE:
            tail = Block(block.segment, block.offset + size, rest)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, tail)
            self._cache(tail)
            block.size = size
        if self.expandable and not self._map(block, limit):
            self._cache(block)
            self._merge(block)
            return None
        block.allocated = True
        self.allocated_bytes += block.size
        return block

    def _grow(self, size: int, small: bool, limit: int | None) -> Block | None:
        """A new free block of at least ``size`` bytes: a new segment, or (expandable) the pool's range extended."""
        if self.expandable:
            segment = self._pools.get(small)
            if segment is None:
                segment = self._pools[small] = _Segment(small, 0)
                self._segments.append(segment)
            last = segment.blocks[-1] if segment.blocks and not segment.blocks[-1].allocated else None
            grow = size - (last.size if last is not None else 0)
            if last is not None:
                self._uncache(last)
                last.size += grow
            else:
                last = Block(segment, segment.size, grow)
                segment.blocks.append(last)
            segment.size += grow
            self._cache(last)
            return last  # its pages are mapped when a block of it goes live
        new = segment_size(size)
        if limit is not None and self.reserved_bytes + new > limit:
            return None
        segment = _Segment(small, new)
        block = Block(segment, 0, new)
        segment.blocks.append(block)
        self._segments.append(segment)
        self.reserved_bytes += new
        self._cache(block)
        return block

    def _map(self, block: Block, limit: int | None) -> bool:
        """Expandable: map the pages ``block`` touches; ``False`` when that would pass ``limit``."""
        small = block.segment.small
        page, pages = _page_size(small), _pages(block.offset, block.size, small)
        new = [index for index in pages if index not in self._mapped[small]]
        if limit is not None and self.reserved_bytes + len(new) * page > limit:
            self.empty_cache()  # it may unmap pages of this block too (not live yet): counted again below
            new = [index for index in pages if index not in self._mapped[small]]
            if self.reserved_bytes + len(new) * page > limit:
                return False
        self._mapped[small].update(new)
        self.reserved_bytes += len(new) * page
        return True

    def free(self, block: Block) -> None:
        """Return a live block to the cache (reserved bytes stay until :meth:`empty_cache`)."""
        block.allocated = False
        self.allocated_bytes -= block.size
        self._cache(block)
        self._merge(block)

    def _merge(self, block: Block) -> None:
        """Merge the free ``block`` with its free neighbours in its segment."""
        blocks = block.segment.blocks
        index = blocks.index(block)
        for neighbour_index in (index + 1, index - 1):
            if 0 <= neighbour_index < len(blocks) and not blocks[neighbour_index].allocated:
                neighbour = blocks[neighbour_index]
                first, second = (block, neighbour) if neighbour_index > index else (neighbour, block)
                self._uncache(first)
                self._uncache(second)
                first.size += second.size
                blocks.remove(second)
                self._cache(first)
                block = first
                index = blocks.index(block)

    def empty_cache(self) -> int:
        """Release every cached segment (expandable: every mapped page) that holds no live block; the bytes released."""
        before = self.reserved_bytes
        if self.expandable:
            for small, segment in self._pools.items():
                live = {index for b in segment.blocks if b.allocated for index in _pages(b.offset, b.size, small)}
                self.reserved_bytes -= (len(self._mapped[small]) - len(live)) * _page_size(small)
                self._mapped[small] = live
            return before - self.reserved_bytes
        kept = []
        for segment in self._segments:
            if len(segment.blocks) == 1 and not segment.blocks[0].allocated:
                self._uncache(segment.blocks[0])
                self.reserved_bytes -= segment.size
            else:
                kept.append(segment)
        self._segments = kept
        return before - self.reserved_bytes

    def largest_free_block(self) -> int:
        """The largest cached free block, in bytes (what one request can take without a new segment).

        Example:
            >>> from elastic_batches.testing.allocator import CachingAllocator
            >>> CachingAllocator().largest_free_block()
            0
        """
        sizes = [free[-1][0] for free in self._free.values() if free]
        return max(sizes, default=0)
