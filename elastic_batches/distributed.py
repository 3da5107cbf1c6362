"""Agreement across ranks and gradient synchronisation that an OOM on one rank cannot hang.

The protocol (see ``docs/distributed.md`` for the sequence on two ranks):

1. Every microbatch runs with the framework's gradient synchronisation off (DDP ``no_sync``),
   so no collective is in flight while a rank may raise an OOM.
2. After the last microbatch — or after an OOM or an error — every rank enters one small
   ``all_gather``: its outcome (ok, OOM, error), the size of its largest microbatch, and its
   weight total (rows, or counted items with ``count_fn``).
3. If any rank failed, every rank discards the step's gradients and learns the same thing;
   otherwise each rank scales its gradients by ``total_r / sum(totals)`` and one bucketed
   ``all_reduce(SUM)`` gives the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["OK", "OOM", "ERROR", "GradientSync", "Verdict", "gradient_sync_for"]

OK, OOM, ERROR = 0, 1, 2
_BUCKET_BYTES = 25 * 1024 * 1024


class Verdict(NamedTuple):
    """What all ranks learned from one attempt.

    Attributes:
        status: The worst outcome over ranks: ``OK``, ``OOM`` or ``ERROR``.
        oom_size: The smallest microbatch size (rows) that ran out of memory; 0 without OOM.
        size: The smallest over ranks of each rank's largest microbatch (rows).
        scale: This rank's share of the global mean: ``total_r / sum(totals)`` (1 alone).
        error_ranks: Ranks whose attempt raised an error other than an OOM.
    """

    status: int
    oom_size: int
    size: int
    scale: float
    error_ranks: tuple[int, ...]


class GradientSync:
    """Single process: nothing to agree on, nothing to synchronise."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        """The context every microbatch of an attempt runs in."""
        yield

    def vote(self, status: int, size: int, total: float) -> Verdict:
        """Share this rank's outcome of an attempt; every rank gets the same verdict back."""
        return Verdict(status, size if status == OOM else 0, size, 1.0, (0,) if status == ERROR else ())

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        """Turn the ``.grad`` of ``params`` (this rank's mean over its batch) into the global mean, in place.

        A parameter without ``.grad`` (unused by ``loss_fn``) keeps none.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if scale != 1.0 and grads:
            torch._foreach_mul_(grads, scale)


class _Agreeing(GradientSync):
    """Several ranks: agree on the outcome; gradients are the user's business (a plain module)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if dist.get_backend(group) == dist.Backend.GLOO:
            self.device = torch.device("cpu")
        else:
            self.device = next(model.parameters()).device

    def vote(self, status: int, size: int, total: float) -> Verdict:
        mine = torch.tensor([status, size, total], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = torch.stack(gathered).cpu().tolist()
        statuses = [int(r[0]) for r in rows]
        oom_sizes = [int(r[1]) for r in rows if int(r[0]) == OOM]
        grand_total = sum(r[2] for r in rows)
        return Verdict(
            status=max(statuses),
            oom_size=min(oom_sizes) if oom_sizes else 0,
            size=min(int(r[1]) for r in rows),
            scale=total / grand_total if grand_total else 0.0,
            error_ranks=tuple(rank for rank, s in enumerate(statuses) if s == ERROR),
        )

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        pass


class _DistributedDataParallel(_Agreeing):
    """DDP: microbatches under ``no_sync``; one bucketed all-reduce after the vote."""

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        super().__init__(model, model.process_group)
        self.ddp = model

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        # DDP broadcasts buffers at the start of a forward when the previous forward synced;
        # that collective could meet a rank that is elsewhere after an OOM: buffers are
        # broadcast after the vote instead (``reduce``).
        self.ddp.require_forward_param_sync = False
        with self.ddp.no_sync():
            yield

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        # Every rank must reduce the same tensors: a parameter unused here may be used elsewhere.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        for bucket in _buckets(grads):
            flat = _flatten_dense_tensors(bucket)
            flat.mul_(scale)
            dist.all_reduce(flat, group=self.group)
            for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(synced)
        if self.ddp.broadcast_buffers:
            buffers = [b for b in self.ddp.module.buffers() if b.numel()]
            for bucket in _buckets(buffers):
                flat = _flatten_dense_tensors(bucket)
                dist.broadcast(flat, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
                for buffer, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    buffer.copy_(synced)


def _buckets(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of same-dtype, same-device tensors of about ``_BUCKET_BYTES`` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and (
            size >= _BUCKET_BYTES or tensor.dtype != bucket[0].dtype or tensor.device != bucket[0].device
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def gradient_sync_for(model: nn.Module) -> GradientSync:
    """The synchronisation scheme for ``model``: alone, DDP, or a plain module on several ranks.

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import gradient_sync_for
        >>> type(gradient_sync_for(torch.nn.Linear(2, 2))).__name__
        'GradientSync'
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return GradientSync(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return _DistributedDataParallel(model)
    return _Agreeing(model)
