"""Gradients in buckets over flat buffers allocated once, so that reducing them allocates nothing.

A tensor split between two buckets is copied through a view of its elements in memory order;
any dense layout (channels-last included) has one, which is the layout autograd gives a
gradient of a dense parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from elastic_batches.distributed.wire import BYTE_CARRIERS

__all__ = ["DEFAULT_BUCKET_BYTES", "FlatPlan", "group_by_bytes"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's own default bucket size


def group_by_bytes(sizes: Sequence[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors of ``sizes`` elements, grouped in about ``bucket_bytes``."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    nbytes = 0
    for index, numel in enumerate(sizes):
        if bucket and nbytes >= bucket_bytes:
            buckets.append(bucket)
            bucket, nbytes = [], 0
        bucket.append(index)
        nbytes += numel * element_size
    if bucket:
        buckets.append(bucket)
    return buckets


def _by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        kinds.setdefault((tensor.dtype, tensor.device), []).append(index)
    return kinds


def _memory_order(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s elements as a 1-D view in the order they lie in memory; ``None`` unless one dense block.

    Autograd gives a gradient the layout of its parameter when that is dense (channels-last
    included) and a contiguous one otherwise, so a gradient always has such a view.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    permuted = tensor.permute(sorted(range(tensor.dim()), key=tensor.stride, reverse=True))
    return permuted.view(-1) if permuted.is_contiguous() else None


def _segments(
    numels: Sequence[int], splittable: Sequence[bool], capacity: int, first: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Buckets of ``(index, start, stop)`` (elements of tensor ``index``) of at most ``capacity`` elements.

    Consecutive tensors fill a bucket; a splittable tensor continues in the next bucket where
    one is full, so that no bucket exceeds ``capacity`` (the first: ``first``, when given). A
    tensor that cannot be split goes whole into a bucket (alone when it is larger than
    ``capacity``). Empty tensors are left out.
    """
    buckets: list[list[tuple[int, int, int]]] = []
    bucket: list[tuple[int, int, int]] = []
    room = capacity if first is None else first
    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            whole = not splittable[index]
            if bucket and (room <= 0 or (whole and numel > room)):
                buckets.append(bucket)
                bucket, room = [], capacity
            stop = numel if whole else min(numel, start + room)
            bucket.append((index, start, stop))
            room -= stop - start
            start = stop
    if bucket:
        buckets.append(bucket)
    return buckets


@dataclasses.dataclass
class _Bucket:
    """Segments of tensors reduced together in one collective, through views of a persistent flat buffer."""

    segments: list[tuple[int, int, int]]  # (tensor index, start, stop) over the tensor's elements in memory order
    views: list[torch.Tensor]  # per segment, where it lies in the flat buffer (shaped as the tensor if whole)
    flat: torch.Tensor  # the used part of the flat buffer: the concatenated segments


class FlatPlan:
    """Tensors in buckets of at most ``bucket_bytes``, one flat buffer per dtype and device, reused per bucket.

    The buffers are allocated once, here, and kept with the plan: nothing is allocated when a
    bucket runs. With ``separate``, every bucket has a buffer of its own (the size of all the
    tensors together, as DDP's own buckets), so that several buckets can be in flight at once.
    With ``vote_numel``, the first bucket belongs to a dtype that can carry a vote
    (``wire.BYTE_CARRIERS``) and ``vote_numel`` more elements follow it in its buffer: ``fused``
    is the first bucket and that vote segment, reduced in one collective.

    Args:
        tensors: What the buckets will hold (the parameters, for their gradients; their
            shapes, dtypes, devices and layouts).
        bucket_bytes: The most one bucket holds.
        vote_numel: Elements of the vote segment; 0: none.
        separate: A buffer per bucket instead of one per dtype and device.
        first_bytes: The most the first bucket of each dtype and device holds (``bucket_bytes``
            when ``None``).

    Example:
        >>> import torch
        >>> from elastic_batches.distributed.gradient_buckets import FlatPlan
        >>> grads = [torch.ones(3), torch.ones(5)]
        >>> plan = FlatPlan(grads, bucket_bytes=16, separate=True)
        >>> [len(b.flat) for b in plan.buckets], plan.holders
        ([4, 4], [[0], [0, 1]])
        >>> flat = plan.fill(1, plan.parts(1, grads), 2.0)
        >>> flat.tolist()
        [2.0, 2.0, 2.0, 2.0]
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        bucket_bytes: int,
        vote_numel: int = 0,
        *,
        separate: bool = False,
        first_bytes: int | None = None,
    ) -> None:
        self.splittable = [_memory_order(t) is not None for t in tensors]
        self.cut: set[int] = set()  # tensors split between buckets: copied through their memory-order views
        kinds = list(_by_kind(tensors).items())
        carriers = [k for k, ((dtype, _), _) in enumerate(kinds) if dtype in BYTE_CARRIERS]
        if vote_numel and carriers:
            kinds.insert(0, kinds.pop(carriers[0]))
        self.buckets: list[_Bucket] = []
        self.fused: torch.Tensor | None = None
        self.vote: torch.Tensor | None = None
        self.holders: list[list[int]] = [[] for _ in tensors]  # per tensor, the buckets that hold a part of it
        for kind, ((dtype, device), indices) in enumerate(kinds):
            capacity = max(1, bucket_bytes // dtype.itemsize)
            first = None if first_bytes is None else max(1, first_bytes // dtype.itemsize)
            numels = [tensors[i].numel() for i in indices]
            grouped = _segments(numels, [self.splittable[i] for i in indices], capacity, first)
            if not grouped:
                continue
            sizes = [sum(stop - start for _, start, stop in bucket) for bucket in grouped]
            extra = vote_numel if kind == 0 and carriers else 0
            shared = None if separate else torch.empty(max(max(sizes), sizes[0] + extra), dtype=dtype, device=device)
            for number, (bucket, size) in enumerate(zip(grouped, sizes, strict=True)):
                head = extra if number == 0 else 0
                buffer = shared if shared is not None else torch.empty(size + head, dtype=dtype, device=device)
                if head:
                    self.fused = buffer[: size + head]
                    self.vote = buffer[size : size + head]
                segments = [(indices[j], start, stop) for j, start, stop in bucket]
                for i in dict.fromkeys(i for i, _, _ in segments):
                    self.holders[i].append(len(self.buckets))
                views, offset = [], 0
                for i, start, stop in segments:
                    view = buffer[offset : offset + stop - start]
                    if start == 0 and stop == tensors[i].numel():
                        view = view.view(tensors[i].shape)  # a whole tensor: copied as it is, whatever its layout
                    else:
                        self.cut.add(i)
                    views.append(view)
                    offset += stop - start
                self.buckets.append(_Bucket(segments, views, buffer[:size]))

    def bind(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per bucket, the parts of ``tensors`` (shaped as the plan's) that its segments copy.

        A tensor that lies whole in one bucket is its own part; one split between buckets is cut
        from its elements in memory order.

        Raises:
            RuntimeError: a tensor that the plan splits is not one dense block (a gradient
                assigned by hand with another layout than its parameter's).
        """
        return [self.parts(index, tensors) for index in range(len(self.buckets))]

    def parts(self, index: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Bucket ``index``'s part of :meth:`bind`: only the tensors it holds are read.

        Raises:
            RuntimeError: as :meth:`bind`.
        """
        return [
            tensors[i] if i not in self.cut else self._ordered(tensors[i])[start:stop]
            for i, start, stop in self.buckets[index].segments
        ]

    @staticmethod
    def _ordered(tensor: torch.Tensor) -> torch.Tensor:
        view = _memory_order(tensor)
        if view is None:
            raise RuntimeError(
                f"ElasticStep: a gradient of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
                "one dense block, as its parameter is: give it its parameter's layout (torch.empty_like)"
            )
        return view

    def fill(self, index: int, parts: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Copy ``parts`` (bucket ``index``'s, from :meth:`bind`) into the flat buffer, times ``scale``."""
        bucket = self.buckets[index]
        if scale == 1.0:
            torch._foreach_copy_(bucket.views, parts)
        else:  # scaled as copied: one pass over the gradients, not two
            for view, part in zip(bucket.views, parts, strict=True):
                torch.mul(part, scale, out=view)
        return bucket.flat

    def drain(self, index: int, parts: list[torch.Tensor], scale: float = 1.0) -> None:
        """Copy bucket ``index``'s flat buffer, times ``scale``, back into ``parts``."""
        bucket = self.buckets[index]
        if scale == 1.0:
            torch._foreach_copy_(parts, bucket.views)
        else:
            for view, part in zip(bucket.views, parts, strict=True):
                torch.mul(view, scale, out=part)
