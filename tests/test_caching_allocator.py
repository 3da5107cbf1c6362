"""``MemoryBudget(allocator="caching" | "expandable")``: CUDA's caching allocator, modelled in bytes on a CPU."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.oom import release_memory
from elastic_batches.testing import MemoryBudget
from elastic_batches.testing.allocator import CachingAllocator, round_size, segment_size

KiB = 1 << 10
MiB = 1 << 20


def _mib(n: float) -> torch.Tensor:
    """A float32 tensor of ``n`` MiB."""
    return torch.empty(int(n * MiB) // 4)


def test_exact_is_the_default_and_reserves_what_is_live() -> None:
    budget = MemoryBudget(limit_bytes=8 * MiB)
    with budget:
        x = _mib(3)
    assert budget.allocator == "exact"
    assert budget.live_bytes == budget.reserved_bytes == 3 * MiB
    del x
    assert budget.peak_reserved_bytes == budget.peak_bytes == 3 * MiB


def test_an_unknown_allocator_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"allocator must be one of \['exact', 'caching', 'expandable'\], got 'cuda'"):
        MemoryBudget(allocator="cuda")


def test_sizes_are_rounded_and_segments_sized_as_cuda_does() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 4000)] == [512, 512, 512, 1024, 4096]
    # small requests: 2 MiB segments; up to 10 MiB: 20 MiB segments; larger: rounded up to 2 MiB
    assert [segment_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)] == [
        2 * MiB,
        2 * MiB,
        20 * MiB,
        20 * MiB,
        10 * MiB,
        12 * MiB,
    ]


def test_small_requests_share_a_2_mib_segment_and_medium_ones_a_20_mib_segment() -> None:
    budget = MemoryBudget(allocator="caching")
    with budget:
        small = [torch.empty(25_000) for _ in range(10)]  # 100 kB each: one 2 MiB segment holds them all
        assert budget.reserved_bytes == 2 * MiB
        medium = [_mib(3) for _ in range(6)]  # 18 MiB: one 20 MiB segment, split for each
        assert budget.reserved_bytes == 22 * MiB
        large = _mib(11)  # its own segment, rounded up to 12 MiB
    assert budget.reserved_bytes == 34 * MiB and budget.live_bytes == 1_000_000 + 29 * MiB
    del small, medium, large


def test_freed_blocks_stay_cached_and_are_reused_best_fit() -> None:
    allocator = CachingAllocator()
    big = allocator.malloc(12 * MiB, limit=None)  # a 12 MiB segment
    medium = allocator.malloc(3 * MiB, limit=None)  # a 20 MiB segment
    assert big is not None and medium is not None
    allocator.free(big)
    allocator.free(medium)
    assert allocator.reserved_bytes == 32 * MiB and allocator.allocated_bytes == 0
    again = allocator.malloc(11 * MiB, limit=None)  # fits both free blocks: the smaller one, the 12 MiB segment
    assert again is not None and again.segment is big.segment and allocator.reserved_bytes == 32 * MiB
    assert allocator.largest_free_block() == 20 * MiB


def test_fragmentation_runs_out_of_memory_with_fewer_live_bytes_than_the_limit() -> None:
    budget = MemoryBudget(limit_bytes=40 * MiB, allocator="caching")
    with budget:
        blocks = [_mib(3) for _ in range(12)]  # two 20 MiB segments, 6 blocks of 3 MiB in each
        del blocks[::2]  # 18 MiB free, in 3 MiB holes: no segment is free as a whole
        assert budget.live_bytes == 18 * MiB and budget.reserved_bytes == 40 * MiB
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 12\.00 MiB.*reserved by PyTorch but"):
            _mib(12)
    assert budget.oom_count == 1


@pytest.mark.parametrize("allocator", ["caching", "expandable"])
@pytest.mark.parametrize(
    ("tensor", "reported"), [(512 * KiB, "2.00 MiB"), (3 * MiB, "20.00 MiB"), (11 * MiB, "12.00 MiB")]
)
def test_an_oom_says_the_segment_it_tried_to_reserve_as_cuda_does(allocator: str, tensor: int, reported: str) -> None:
    # CUDA's "Tried to allocate" is the allocation size of the request's pool (get_allocation_size), not the tensor's.
    budget = MemoryBudget(limit_bytes=1 * MiB, allocator=allocator)
    with budget, pytest.raises(torch.OutOfMemoryError, match=rf"Tried to allocate {re.escape(reported)}\. GPU 0"):
        torch.empty(tensor, dtype=torch.uint8)


@pytest.mark.parametrize(("allocator", "fits"), [("caching", False), ("expandable", True)])
def test_expandable_segments_merge_free_neighbours_across_what_were_segments(allocator: str, fits: bool) -> None:
    budget = MemoryBudget(limit_bytes=40 * MiB, allocator=allocator)
    with budget:
        blocks = [_mib(3) for _ in range(12)]  # caching: blocks 0-5 in one 20 MiB segment, 6-11 in another
        del blocks[3:9]  # 18 MiB free in a row; caching: 11 MiB at the end of one segment, 9 at the next one's start
        try:
            x = _mib(12)
        except torch.OutOfMemoryError:
            x = None
    assert (x is not None) is fits and budget.reserved_bytes == 40 * MiB
    del x, blocks


def test_expandable_pages_are_2_mib_in_the_small_pool_and_20_mib_in_the_large() -> None:
    budget = MemoryBudget(allocator="expandable")
    with budget:
        small = torch.empty(1024)  # 4 KiB: one 2 MiB page of the small pool
        assert budget.reserved_bytes == 2 * MiB
        large = _mib(3)  # the large pool maps 20 MiB at a time, as its ExpandableSegment does
        assert budget.reserved_bytes == 22 * MiB
        more = _mib(18)  # 21 MiB of the large range: a second page
        assert budget.reserved_bytes == 42 * MiB
        del large
    budget.empty_cache()  # both large pages still hold a live block: only the small page's is free, and it is live
    assert budget.reserved_bytes == 42 * MiB
    del more, small
    budget.empty_cache()
    assert budget.reserved_bytes == 0


def test_expandable_segments_keep_the_holes_between_live_blocks() -> None:
    budget = MemoryBudget(limit_bytes=40 * MiB, allocator="expandable")
    with budget:
        blocks = [_mib(3) for _ in range(12)]  # 36 MiB of the large range: two 20 MiB pages
        del blocks[::2]  # 18 MiB free, in 3 MiB holes between live blocks: both pages still hold one
        with pytest.raises(torch.OutOfMemoryError):
            _mib(12)  # at the range's end: a third page, past the limit
    assert budget.live_bytes == 18 * MiB
    del blocks


def test_cached_segments_are_released_and_the_allocation_tried_again_before_an_oom() -> None:
    budget = MemoryBudget(limit_bytes=17 * MiB, allocator="caching")
    with budget:
        x = _mib(1)
        del x
        assert budget.reserved_bytes == 2 * MiB  # a small-pool segment, cached and free
        y = _mib(16)  # a new 16 MiB segment: 2 + 16 > 17, so the free segment is released first, then it fits
    assert budget.oom_count == 0 and budget.reserved_bytes == 16 * MiB and budget.peak_reserved_bytes == 16 * MiB
    del y


def test_empty_cache_and_release_memory_hand_cached_segments_back() -> None:
    budget = MemoryBudget(allocator="caching")
    with budget:
        kept, freed = _mib(3), _mib(20)  # the 20 MiB one does not fit the first segment's 17 free MiB
        del freed
        assert budget.reserved_bytes == 40 * MiB
        release_memory()  # what ElasticStep calls after an OOM: empties the active budget's cache
        assert budget.reserved_bytes == 20 * MiB  # the segment with a live block stays
        del kept
    budget.empty_cache()
    assert budget.reserved_bytes == 0 and budget.peak_reserved_bytes == 40 * MiB
    budget.reset_peak()
    assert budget.peak_reserved_bytes == 0


def test_a_storage_resize_allocates_a_new_block_and_frees_the_old() -> None:
    kept = _mib(3)
    budget = MemoryBudget(limit_bytes=40 * MiB, allocator="caching")
    with budget:
        storage = kept.untyped_storage()
        storage.resize_(0)  # freed, as FSDP2 frees an unsharded parameter: from before the mode, nothing counted
        assert budget.reserved_bytes == 0
        storage.resize_(3 * MiB)  # allocated again inside: a block of a 20 MiB segment
        assert budget.live_bytes == 3 * MiB and budget.reserved_bytes == 20 * MiB
        storage.resize_(0)
    assert budget.live_bytes == 0 and budget.reserved_bytes == 20 * MiB


@pytest.mark.parametrize("allocator", ["caching", "expandable"])
def test_a_step_under_the_caching_allocator_retries_and_leaves_the_full_batch_gradient(allocator: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1))
    batch = (torch.randn(4096, 256), torch.randn(4096, 1))  # 16 MiB per activation of the hidden layer

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (model(mb[0]) - mb[1]).pow(2).mean()

    loss_fn(batch).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    budget = MemoryBudget(limit_bytes=24 * MiB, allocator=allocator)  # the full batch's activations need more
    step = eb.ElasticStep(model, memory=None)
    with budget:
        step.backward(batch, loss_fn)
    assert budget.oom_count >= 1 and step.controller.split_count > 1
    assert budget.peak_reserved_bytes <= 24 * MiB
    for got, expected in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("allocator", ["caching", "expandable"])
def test_the_capacity_the_budget_reports_is_its_limit_in_whole_2_mib_segments(allocator: str) -> None:
    assert MemoryBudget(5 * MiB + 1, allocator=allocator).memory_reading().capacity == 4 * MiB
    assert MemoryBudget(6 * MiB, allocator=allocator).memory_reading().capacity == 6 * MiB
    assert MemoryBudget(5 * MiB + 1).memory_reading().capacity == 5 * MiB + 1  # exact: every byte can be live


def test_prediction_under_a_limit_between_two_segments_settles_without_an_oom() -> None:
    """An activation-heavy MLP whose microbatches' tensors fit the small pool's 2 MiB segments, under a limit of
    3 MiB: only one segment can ever be reserved, and a plan for 3 MiB of live bytes runs out of memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1024), nn.Tanh(), nn.Linear(1024, 1))
    generator = torch.Generator().manual_seed(512)
    batch = {"x": torch.randn(512, 8, generator=generator), "y": torch.randn(512, 1, generator=generator)}
    budget = MemoryBudget(limit_bytes=3 * MiB, allocator="caching")
    step = eb.ElasticStep(model, memory=budget)
    counts = []
    for _ in range(4):
        with budget:
            step.backward(batch, lambda mb: (model(mb["x"]) - mb["y"]).pow(2).mean())
        model.zero_grad(set_to_none=True)
        counts.append(step.controller.split_count)
    assert budget.oom_count == 0
    assert counts[1:] == [4, 4, 4]  # the fewest that fit: 4 microbatches of 128 rows (512 KiB per activation)
    assert budget.peak_reserved_bytes <= 2 * MiB


def _reserved_by_layout(allocator: CachingAllocator) -> int:
    """The bytes the allocator's layout holds: its segments, or (expandable) its mapped pages."""
    if not allocator.expandable:
        return sum(segment.size for segment in allocator._segments)
    return sum(len(pages) * (2 * MiB if small else 20 * MiB) for small, pages in allocator._mapped.items())


@pytest.mark.parametrize("expandable", [False, True], ids=["caching", "expandable"])
@pytest.mark.parametrize("seed", range(4))
def test_the_reserved_bytes_are_what_the_layout_holds_through_random_requests(expandable: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    allocator, limit, live = CachingAllocator(expandable=expandable), 64 * MiB, []
    for _ in range(400):
        draw = int(torch.randint(10, (1,), generator=generator))
        if draw < 4 and live:  # free one of the live blocks
            allocator.free(live.pop(int(torch.randint(len(live), (1,), generator=generator))))
        elif draw == 4:
            allocator.empty_cache()
        else:  # a small (4 KiB-1 MiB), a middle (1-10 MiB) or a large (10-30 MiB) request
            low, high = [(4 << 10, MiB), (MiB + 1, 10 * MiB - 1), (10 * MiB, 30 * MiB)][draw % 3]
            block = allocator.malloc(int(torch.randint(low, high, (1,), generator=generator)), limit=limit)
            if block is not None:
                live.append(block)
        assert allocator.reserved_bytes == _reserved_by_layout(allocator) <= limit
        assert allocator.allocated_bytes == sum(block.size for block in live)
        if expandable:  # every page a live block touches is mapped
            for block in live:
                page = 2 * MiB if block.segment.small else 20 * MiB
                touched = range(block.offset // page, -(-(block.offset + block.size) // page))
                assert set(touched) <= allocator._mapped[block.segment.small]
