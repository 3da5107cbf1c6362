"""DDP: the last microbatch's gradient buckets all-reduced during its backward, on 2 gloo ranks.

The model is cut into four buckets (``bucket_bytes=512``: 401 float32 gradients, 128 to a
bucket), so that the last microbatch's backward can start three of them before the vote's. The
reference is plain full-batch training on the union of both ranks' batches; weights must match
it within ``RTOL`` (float32, relative).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches.distributed import ddp, gradient_sync_for
from elastic_batches.testing import inject_oom

from support.ranks import RankPool

RTOL = 1e-6
LR = 0.1
BUCKET_BYTES = 512


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("ranks"), world_size=2)
    yield pool
    pool.close()


class _Model(nn.Module):
    """6 -> 16 -> 16 -> 1; with ``branch``, a layer that only the ranks told to use it use (unused elsewhere).

    The branch's parameters come first: they lie in the vote's bucket. (A parameter that the last
    microbatch leaves unused holds back its bucket, and every bucket after it in the schedule,
    until the vote.)
    """

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branch = nn.Linear(6, 1) if branch else None
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        out = self.net(x)
        return out + self.branch(x) if branch and self.branch is not None else out


def _batch(step: int, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``y`` and a mask of counted items (``count_fn``) of ``rows`` rows."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, 6, generator=generator)
    y = x[:, :1].sin() + 0.1 * torch.randn(rows, 1, generator=generator)
    mask = (torch.rand(rows, 1, generator=generator) < 0.7).float()
    return x, y, mask


def _loss(model: nn.Module, mb: Any, branch: bool, counted: bool) -> torch.Tensor:
    x, y, mask = mb
    errors = (model(x, branch) - y).pow(2)
    return (errors * mask).sum() / mask.sum() if counted else errors.mean()


def _union_loss(model: nn.Module, step: int, rows: list[int], branches: list[bool], counted: bool) -> torch.Tensor:
    """The loss of full-batch training on every rank's batch (the branch on the rows of the ranks that use it)."""
    parts = [_batch(step, r, n) for r, n in enumerate(rows)]
    errors = torch.cat([(model(x, b) - y).pow(2) for (x, y, _), b in zip(parts, branches, strict=True)])
    mask = torch.cat([m for _, _, m in parts])
    return (errors * mask).sum() / mask.sum() if counted else errors.mean()


@contextlib.contextmanager
def _counting_all_reduce() -> Iterator[dict[str, int]]:
    """Count ``dist.all_reduce`` calls, and those made inside a backward (the last microbatch's hooks)."""
    counts = {"all": 0, "in_backward": 0}
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts["all"] += 1
        counts["in_backward"] += int(torch._C._current_graph_task_id() != -1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield counts
    finally:
        dist.all_reduce = original


def _train(
    rank: int,
    world: int,
    *,
    rows: list[int],
    counted: bool = False,
    branch_ranks: tuple[int, ...] | None = None,
    freeze_until: int = 0,
    oom: tuple[str, list[int], int] | None = None,
    overlap: bool = True,
    steps: int = 4,
) -> dict[str, Any]:
    """``steps`` steps of split 3 under DDP in four buckets, AdamW, against full-batch training on one process.

    ``branch_ranks``: the ranks whose loss uses the branch (DDP with ``find_unused_parameters``; ``None``: no
    branch);
    ``freeze_until``: the first layer is frozen before that step; ``oom``: ``(phase, calls, rank)``
    on the first layer (``"backward"``: after the later layers' buckets started).
    """
    plain = _Model(branch_ranks is not None)
    reference = _Model(branch_ranks is not None)
    for module in (plain, reference):
        module.net[0].requires_grad_(freeze_until == 0)
    model = nn.parallel.DistributedDataParallel(plain, find_unused_parameters=branch_ranks is not None)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    step.sync = ddp.DistributedDataParallel(model, bucket_bytes=BUCKET_BYTES, overlap=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.5)  # moves zero gradients, skips None
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.5)
    handle = None if oom is None else inject_oom(plain.net[0], phase=oom[0], calls=oom[1], rank=oom[2])  # type: ignore
    branches = [r in (branch_ranks or ()) for r in range(world)]
    per_step = []
    for i in range(steps):
        if i == freeze_until and i > 0:
            plain.net[0].requires_grad_(True)
            reference.net[0].requires_grad_(True)
        optimizer.zero_grad(set_to_none=True)
        with _counting_all_reduce() as counts:
            step.backward(
                _batch(i, rank, rows[rank]),
                lambda mb: _loss(model, mb, branches[rank], counted),
                count_fn=(lambda mb: mb[2].sum()) if counted else None,
            )
        per_step.append(counts)
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        _union_loss(reference, i, rows, branches, counted).backward()
        reference_optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert isinstance(step.sync, ddp.DistributedDataParallel) and step.sync._plan is not None
    return {
        "error": float((weights - expected).abs().max() / expected.abs().max()),
        "per_step": per_step,
        "buckets": len(step.sync._plan.buckets),
        "fired": 0 if handle is None else handle.fired,
        "oom_count": step.controller.oom_count,
        "branch_grad": plain.branch is not None and plain.branch.weight.grad is not None,
    }


def test_the_last_microbatch_starts_every_bucket_but_the_vote_s_during_its_backward(ranks: RankPool) -> None:
    for result in ranks.run(_train, rows=[12, 7], timeout=60):
        assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"
        assert result["buckets"] == 4
        first, *steady = result["per_step"]
        assert first == {"all": 4, "in_backward": 0}  # the first step confirms the plan: nothing overlapped yet
        for counts in steady:  # three buckets start in the last backward; the vote's after it
            assert counts == {"all": 4, "in_backward": 3}


def test_without_overlap_every_bucket_is_reduced_after_the_backward(ranks: RankPool) -> None:
    for result in ranks.run(_train, rows=[12, 7], overlap=False, timeout=60):
        assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"
        assert [c["in_backward"] for c in result["per_step"]] == [0, 0, 0, 0]


CASES = {
    "uneven-splits": {"rows": [12, 7]},
    "count-fn": {"rows": [12, 7], "counted": True},
    "unused-on-rank1": {"rows": [12, 7], "branch_ranks": (0,)},
    "unused-everywhere": {"rows": [12, 7], "branch_ranks": ()},
    "frozen-then-trained": {"rows": [12, 7], "freeze_until": 2},
    # forward calls 3, 4, 5 are step 1's microbatches (its first overlapped step)
    "oom-last-backward-rank1": {"rows": [12, 12], "oom": ("backward", [5], 1)},
    "oom-last-forward-rank0": {"rows": [12, 12], "oom": ("forward", [5], 0)},
    "oom-first-microbatch-rank0": {"rows": [12, 12], "oom": ("forward", [3], 0)},
    "oom-in-the-retry-rank1": {"rows": [12, 7], "counted": True, "oom": ("backward", [5, 11], 1)},
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_overlapped_steps_equal_full_batch_training(ranks: RankPool, case: dict[str, Any]) -> None:
    results = ranks.run(_train, timeout=60, **case)
    oom = case.get("oom")
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"
        assert result["fired"] == (len(oom[1]) if oom is not None and oom[2] == rank else 0)
        assert result["oom_count"] == (len(oom[1]) if oom is not None else 0), "every rank learned of each OOM"
        assert result["branch_grad"] == bool(case.get("branch_ranks")), "a parameter no rank used keeps None"
        assert result["per_step"][-1]["in_backward"] == 3


def _backward_twice(rank: int, world: int) -> str:
    """A ``backward_fn`` that runs backward twice: the second time, a bucket it fills has already started."""
    model = nn.parallel.DistributedDataParallel(_Model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    step.sync = gradient_sync_for(model, bucket_bytes=BUCKET_BYTES)

    def twice(loss: torch.Tensor) -> None:
        (loss / 2).backward(retain_graph=True)
        (loss / 2).backward()

    step.backward_fn = twice
    for i in range(2):
        try:
            step.backward(_batch(i, rank, 8), lambda mb: _loss(model, mb, False, False))
        except RuntimeError as err:
            return str(err)
    return "no error"


def test_a_gradient_accumulated_after_its_bucket_started_raises_on_every_rank(ranks: RankPool) -> None:
    for message in ranks.run(_backward_twice, timeout=60):
        assert "accumulated twice in the last microbatch" in message
        assert "overlap=False" in message


def test_a_schedule_dropped_unclosed_removes_its_hooks() -> None:
    """The hooks hold the schedule weakly: a sync that is replaced does not keep its buffers alive through them."""
    import gc
    import weakref

    from elastic_batches.distributed.gradient_buckets import FlatPlan
    from elastic_batches.distributed.overlap import BucketSchedule

    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))]
    schedule = BucketSchedule(FlatPlan(params, bucket_bytes=12, separate=True), params, group=None)
    assert schedule.order == [1] and len(params[0]._post_accumulate_grad_hooks) == 1
    alive = weakref.ref(schedule)
    del schedule
    gc.collect()
    assert alive() is None
    assert not params[0]._post_accumulate_grad_hooks and not params[1]._post_accumulate_grad_hooks
