"""DDP: every microbatch under ``no_sync``; the last one's buckets all-reduced in its backward, the vote in the first.

``DistributedDataParallel`` never runs its own reducer here. From the second step on, the
buckets but the first start during the last microbatch's backward, as their gradients become
ready, in an order fixed by the plan (``overlap``): a rank that fails anywhere stands in for the
buckets it has not started, from the buffers it holds, so that an OOM cannot strand a peer;
the first bucket carries the vote. On one rank there is nothing to reduce, and every
microbatch runs under ``no_sync`` alone (``SingleRankDDP``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from elastic_batches.distributed.gradient_buckets import DEFAULT_BUCKET_BYTES, FlatPlan
from elastic_batches.distributed.overlap import BucketSchedule
from elastic_batches.distributed.plain import Agreeing
from elastic_batches.distributed.protocol import Ballot, GradientSync, Rows, Verdict, verdict_of
from elastic_batches.distributed.wire import VOTE_BYTES, UsedMap, VoteBytes
from elastic_batches.oom import Status

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "DistributedDataParallel", "SingleRankDDP"]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's own first bucket: here the vote's, reduced last and never overlapped


class SingleRankDDP(GradientSync):
    """DDP over one rank: every microbatch under ``no_sync``, and nothing to reduce.

    DDP's reducer would otherwise copy every microbatch's gradients into its buckets and
    all-reduce them with no peer, a cost of the order of the step itself for a small model.
    """

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        super().__init__(model)
        self.ddp = model
        self._fixed_parameters = tuple(model.parameters())

    def microbatches(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()


class DistributedDataParallel(Agreeing):
    """DDP: microbatches under ``no_sync``; the last one's buckets reduced in its backward, the vote in the first.

    The flat buffers of the gradient buckets are allocated at the first ``prepare`` and kept:
    with ``overlap`` (the default) a buffer per bucket, as large as the gradients together
    (the memory of DDP's own buckets), the first bucket at most ``first_bucket_bytes``;
    without, one bucket of at most ``bucket_bytes`` per gradient dtype, reused by every
    bucket. The first bucket is followed by the vote segment (40 elements per rank). Until every
    rank has confirmed in a separate vote that it holds them, votes are separate ``all_gather``
    and every bucket is reduced after it. From then on (the second step), every bucket but the
    first is reduced before the vote, in the order of :class:`~elastic_batches.distributed.overlap.BucketSchedule`:
    with ``overlap``, each starts in the last microbatch's backward as soon as its gradients
    are ready; a rank whose attempt failed joins each bucket it has not started, and the first
    bucket's all-reduce that carries the vote, with zeros, without allocating anything. With
    ``broadcast_buffers`` (DDP's default), a flat copy of the module's buffers is kept too, for
    their broadcast after the vote.

    Args:
        model: The DDP-wrapped module.
        bucket_bytes: The most one gradient bucket holds.
        overlap: Whether the last microbatch's backward starts the buckets' all-reduce.
        first_bucket_bytes: With ``overlap``, the most the first bucket holds, at most ``bucket_bytes`` (the vote's: it
            starts after the backward).

    Example:
        >>> import torch
        >>> from elastic_batches.distributed.ddp import DistributedDataParallel
        >>> DistributedDataParallel.__name__  # needs several ranks: see docs/distributed.md
        'DistributedDataParallel'
    """

    def __init__(
        self,
        model: nn.parallel.DistributedDataParallel,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    ) -> None:
        if model.static_graph:
            raise NotImplementedError(
                "ElasticStep does not support DistributedDataParallel(static_graph=True): its first backward starts "
                "DDP's own reduction, which ElasticStep replaces with its own (vote first, then reduce). Create DDP "
                "without static_graph: its optimizations are for DDP's reduction, which ElasticStep does not use"
            )
        sparse = [
            name
            for name, m in model.module.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        ]
        if sparse:
            raise NotImplementedError(
                f"ElasticStep under DDP reduces dense gradients only; module(s) {sparse} make sparse ones "
                "(sparse=True): create them with sparse=False"
            )
        hooks = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(model, "_comm_hooks", ())]
        if hooks:
            raise NotImplementedError(
                f"ElasticStep reduces the gradients itself and would skip the DDP communication hook(s) {hooks} "
                "registered with register_comm_hook, changing what they do to the gradients: create DDP without them"
            )
        super().__init__(model, model.process_group)
        self.ddp = model
        self._fixed_parameters = tuple(model.parameters())
        # Parameters DDP leaves out of its gradient sync (``_set_params_and_buffers_to_ignore_for_model``).
        ignored = model.parameters_to_ignore
        self._ignored = {id(p) for name, p in model.module.named_parameters() if name in ignored}
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.first_bucket_bytes = first_bucket_bytes
        self._plan: FlatPlan | None = None  # persistent, for the parameters of ``_plan_key``
        self._plan_key: tuple[int, ...] = ()
        self._schedule: BucketSchedule | None = None  # with overlap: the hooks on the parameters of ``_plan_key``
        self._weighed: float | None = None  # this attempt's weight total, known before its microbatches
        # The parameters for which every rank confirmed a plan that fuses: then, and only then, the
        # vote is fused. Changed only by a vote, so it is the same on every rank.
        self._fused_key: tuple[int, ...] | None = None
        self._reference = 1.0  # the last grand total: gradients are pre-scaled by total_r / reference
        self._votes: VoteBytes | None = None  # the vote segment as this rank sends it, and the votes read back
        self._parts: list[list[torch.Tensor]] | None = None  # this attempt's gradients, bound to the plan
        self._factor: float | None = None  # after a fused vote that fitted: the reduced buckets' factor to apply
        self._reduced = 0  # after a fused vote: how many buckets (from the first) it reduced
        self._buffer_plan: FlatPlan | None = None  # persistent, for the buffers of ``_buffer_key``
        self._buffer_key: tuple[int, ...] = ()
        self._buffer_parts: list[list[torch.Tensor]] = []  # this attempt's buffers, bound to the plan
        self._used = UsedMap(self.device, self.group)

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        # DDP broadcasts buffers at the start of a forward when the previous forward synced;
        # that collective could meet a rank that is elsewhere after an OOM: buffers are
        # broadcast after the vote instead (``reduce``).
        self.ddp.require_forward_param_sync = False
        with self.ddp.no_sync():
            yield

    def _synced(self, params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The parameters whose gradients DDP synchronises: all but those it was told to ignore."""
        return [p for p in params if id(p) not in self._ignored] if self._ignored else params

    # Without no_grad: nothing here is recorded by autograd (zeros, views of gradients), and the
    # context would be a fixed cost of every step.
    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        params = self._synced(params)
        self._used.record([p.grad is not None for p in params])
        # Every rank must reduce the same tensors: a parameter unused here may be used elsewhere.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        key = tuple(map(id, params))
        if key != self._plan_key:
            if self._schedule is not None:
                self._schedule.close()
            self._plan, self._plan_key, self._votes, self._schedule = None, (), None, None  # free the old buffers first
            first = min(self.first_bucket_bytes, self.bucket_bytes) if self.overlap else None
            vote = self.world_size * VOTE_BYTES
            plan = FlatPlan(params, self.bucket_bytes, vote_numel=vote, separate=self.overlap, first_bytes=first)
            if plan.vote is not None:
                self._votes = VoteBytes(self.rank, self.world_size, plan.vote.dtype)
            if self.overlap and plan.fused is not None and len(plan.buckets) > 1:  # one bucket: nothing to overlap
                self._schedule = BucketSchedule(plan, params, self.group)
            self._plan, self._plan_key = plan, key
        assert self._plan is not None
        self._parts = self._plan.bind([p.grad for p in params if p.grad is not None])
        buffers = self._synced_buffers()
        key = tuple(map(id, buffers))
        if key != self._buffer_key:
            self._buffer_plan, self._buffer_key = None, ()  # free the old copy first
            self._buffer_plan, self._buffer_key = (FlatPlan(buffers, self.bucket_bytes) if buffers else None), key
        self._buffer_parts = self._buffer_plan.bind(buffers) if self._buffer_plan is not None else []

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The buffers DDP broadcasts from rank 0 at a forward, listed anew each time as DDP does (reassignable).

        As DDP, none when its list from the last listing (at construction) is empty.
        """
        if not self.ddp.broadcast_buffers or not self.ddp.modules_buffers:
            return []
        ignored = self.ddp.parameters_to_ignore
        return [b for name, b in self.ddp.module.named_buffers() if b.numel() and name not in ignored]

    def weigh(self, total: float) -> None:
        self._weighed = total

    def last_microbatch(self) -> None:
        schedule = self._schedule
        if schedule is None or self._weighed is None or self._plan_key != self._fused_key:
            return
        params = self._synced([p for p in self.parameters() if p.requires_grad])
        if tuple(map(id, params)) == self._plan_key:  # the plan every rank confirmed: its order on every rank
            schedule.arm(self._weighed / self._reference)

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        self._weighed = None
        if params is None:
            return super().vote(ballot)
        status, size, total, capacity = ballot
        key = tuple(map(id, self._synced(params)))
        fused = key == self._fused_key
        if fused:
            rows = self._fused_vote(status, size, total, capacity)
        else:
            ready = key == self._plan_key and self._plan is not None and self._plan.fused is not None
            rows = self._exchange((status, size, total, self._used.flag, capacity, float(ready)))
            self._fused_key = key if all(r[5] for r in rows) else None
        verdict = verdict_of(rows, total)
        self._used.learn(verdict.status, rows)
        grand_total = math.fsum(r[2] for r in rows)
        if fused and verdict.status == Status.OK:  # the buckets hold sum_r(total_r * grad_r) / reference
            self._factor = self._reference / grand_total if grand_total else 0.0
        if grand_total:
            self._reference = grand_total
        return verdict

    def _fused_vote(self, status: Status, size: int, total: float, capacity: int) -> Rows:
        """All-reduce the buckets, pre-scaled by ``total / reference``; the first with every rank's vote bytes.

        With ``overlap``, the buckets but the first in the schedule's order (those the last
        microbatch did not start, here); the first in one collective with the vote. A rank
        whose attempt failed sends zeros in place of its gradients. Nothing here allocates on
        the device.
        """
        plan, votes, schedule = self._plan, self._votes, self._schedule
        assert plan is not None and plan.fused is not None and plan.vote is not None and votes is not None
        parts = self._parts if status == Status.OK else None
        scale = total / self._reference
        if schedule is not None:
            schedule.finish(parts, scale)
        if parts is not None:
            plan.fill(0, parts[0], scale)
        else:
            plan.buckets[0].flat.zero_()
        plan.vote.copy_(votes.slots((status, size, total, self._used.flag, capacity)))
        dist.all_reduce(plan.fused, group=self.group)
        if schedule is not None:
            schedule.wait()
        self._reduced = len(plan.buckets) if schedule is not None else 1
        return votes.read(plan.vote)

    def discard(self) -> None:
        self._parts, self._factor, self._reduced, self._buffer_parts = None, None, 0, []
        self._used.reset()

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        if self._parts is None:
            self.prepare(params)
        plan, parts = self._plan, self._parts
        assert plan is not None and parts is not None
        first = 0
        if self._factor is not None:  # the fused vote reduced the first buckets (pre-scaled by total_r / reference)
            first = self._reduced
            for index in range(first):
                plan.drain(index, parts[index], self._factor)
        for index in range(first, len(plan.buckets)):
            dist.all_reduce(plan.fill(index, parts[index], scale), group=self.group)
            plan.drain(index, parts[index])
        synced = self._synced(params)
        for index in self._used.unused_everywhere():
            synced[index].grad = None
        buffer_plan, buffer_parts = self._buffer_plan, self._buffer_parts
        self.discard()
        if buffer_plan is not None and buffer_parts:
            source = dist.get_global_rank(self.ddp.process_group, 0)
            for index in range(len(buffer_plan.buckets)):
                dist.broadcast(buffer_plan.fill(index, buffer_parts[index]), src=source, group=self.group)
                buffer_plan.drain(index, buffer_parts[index])
