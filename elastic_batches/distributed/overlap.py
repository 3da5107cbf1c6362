"""The last microbatch's reduction overlapped with its backward: every bucket but the vote's, in a fixed order.

Every rank all-reduces the buckets of a :class:`~elastic_batches.distributed.gradient_buckets.FlatPlan`
in one order fixed by the plan: the last bucket first (it holds the last parameters, whose
gradients a backward finishes first), the first one (that carries the vote) last. During an
attempt's last microbatch, a bucket starts as soon as the gradients it holds are final and
every bucket before it in the order has started; what has not started by the vote starts
there, from this rank's gradients when its attempt fitted, and otherwise as a stand-in: the
bucket's flat buffer zeroed, which allocates nothing. Every rank therefore runs the same
collectives in the same order, whatever it failed in, and the vote discards the attempt.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from elastic_batches.distributed.gradient_buckets import FlatPlan

__all__ = ["BucketSchedule"]


class _Grads(Sequence[torch.Tensor]):
    """The parameters' ``.grad``, read when a bucket asks for them (a hook sees each one final only then)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        grad = self.params[index].grad
        assert grad is not None  # a post-accumulate-grad hook fired for it
        return grad


def _hook(schedule: weakref.ref[BucketSchedule]) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that does not keep ``schedule`` (and its buffers) alive."""

    def ready(param: torch.Tensor) -> None:
        alive = schedule()
        if alive is not None:
            alive._ready(param)

    return ready


def _remove(hooks: list[torch.utils.hooks.RemovableHandle]) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()


class BucketSchedule:
    """Every bucket of ``plan`` but the first, all-reduced in the last microbatch's backward as it becomes ready.

    Hooks on the parameters (``register_post_accumulate_grad_hook``) do nothing until
    :meth:`arm`; from then until :meth:`finish`, each hook marks its parameter's gradient final,
    and the buckets whose gradients are all final start, in the schedule's order, each as an
    asynchronous ``all_reduce`` of its flat buffer (``plan`` with ``separate=True``: a buffer
    of its own).

    Args:
        plan: The gradients' buckets; its first bucket (the vote's) is not scheduled here.
        params: The parameters, in the plan's order.
        group: The process group.

    Example:
        >>> import torch
        >>> from elastic_batches.distributed.gradient_buckets import FlatPlan
        >>> from elastic_batches.distributed.overlap import BucketSchedule
        >>> params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
        >>> schedule = BucketSchedule(FlatPlan(params, bucket_bytes=12, separate=True), params, group=None)
        >>> schedule.order
        [1]
        >>> schedule.close()
    """

    def __init__(self, plan: FlatPlan, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.plan, self.group = plan, group
        self.order = list(range(len(plan.buckets) - 1, 0, -1))  # the last parameters' bucket first
        self._grads = _Grads(params)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._held = [len({i for i, _, _ in bucket.segments}) for bucket in plan.buckets]
        self._pending: list[int] = []
        self._final: set[int] = set()
        self._scale: float | None = None  # armed: the factor each rank's gradients are sent times
        self._works: list[dist.Work] = []
        hook = _hook(weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
        self._unhook = weakref.finalize(self, _remove, self._hooks)  # a schedule dropped unclosed unhooks too

    def arm(self, scale: float) -> None:
        """Before the last microbatch: its backward starts each bucket, its gradients sent ``scale`` times."""
        self._pending = list(self._held)
        self._final = set()
        self._scale = scale

    def _ready(self, param: torch.Tensor) -> None:
        if self._scale is None:
            return
        index = self._index[id(param)]
        holders = self.plan.holders[index]
        if index in self._final:
            started = {self.order[i] for i in range(len(self._works))}
            if started.intersection(holders):
                raise RuntimeError(
                    f"ElasticStep under DDP: the gradient of parameter {index} (of shape {tuple(param.shape)}) was "
                    "accumulated twice in the last microbatch, after its bucket's all-reduce had started (a "
                    "backward_fn that runs backward more than once): reduce after the last microbatch instead, "
                    "with step.sync = elastic_batches.distributed.ddp.DistributedDataParallel(model, overlap=False)"
                )
            return
        self._final.add(index)
        for bucket in holders:
            self._pending[bucket] -= 1
        scale = self._scale
        while len(self._works) < len(self.order) and self._pending[self.order[len(self._works)]] == 0:
            bucket = self.order[len(self._works)]
            flat = self.plan.fill(bucket, self.plan.parts(bucket, self._grads), scale)
            self._works.append(dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self, parts: Sequence[list[torch.Tensor]] | None, scale: float) -> None:
        """At the vote, before the vote's bucket: start every bucket not started yet, in order.

        Args:
            parts: Every bucket's parts (:meth:`FlatPlan.bind`), when this rank's attempt
                fitted; ``None``: a stand-in, zeros from the flat buffers already held.
            scale: The factor this rank's gradients are sent times.
        """
        self._scale = None
        for bucket in self.order[len(self._works) :]:
            if parts is not None:
                flat = self.plan.fill(bucket, parts[bucket], scale)
            else:
                flat = self.plan.buckets[bucket].flat.zero_()
            self._works.append(dist.all_reduce(flat, group=self.group, async_op=True))

    def wait(self) -> None:
        """After the vote's bucket: every bucket reduced (each rank's sum in its flat buffer)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def close(self) -> None:
        """Remove the hooks (the plan changed); nothing may be in flight."""
        self._unhook()
