"""OOM injection in the buffers of FSDP2's collectives: an all-gather's output, a reduce-scatter's input, a stand-in's.

FSDP2 allocates each collective's buffer through its comm object's ``allocate()`` just before
the collective; these injections raise there, on a chosen rank, as the device's allocator
would: the point where a rank that runs out of memory leaves its peers waiting in the
collective that follows. A rank whose scripted attempt failed allocates one buffer for the
collectives it stands in for (``Script.buffers``): :func:`inject_oom_in_stand_in` raises there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from elastic_batches.testing.injection import OOMInjection, _call_set, _check_rank, _MethodPatch

__all__ = ["inject_oom_in_all_gather", "inject_oom_in_reduce_scatter", "inject_oom_in_stand_in"]


def _comm_classes() -> tuple[type, type]:
    # FSDP2's default comms live in a private module of torch: imported in this one place.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


def inject_oom_in_all_gather(*, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen allocations of an FSDP2 all-gather's output buffer.

    Counts the calls of FSDP2's default all-gather ``allocate()`` (one per all-gather: a
    module's forward or backward unshard, or a prefetch), numbered from 0 over the handle's
    lifetime on each rank, and raises at the chosen ones before anything is allocated. Only one
    injection of this kind can be active at a time.

    Args:
        calls: The allocation number, or numbers, to raise at (from 0). Default: the first.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> import torch
        >>> from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
        >>> from elastic_batches.testing import inject_oom_in_all_gather
        >>> with inject_oom_in_all_gather(calls=1) as oom:
        ...     _ = DefaultAllGather().allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
        ...     try:  # what FSDP2 does before its next all-gather
        ...         DefaultAllGather().allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
        ...     except torch.OutOfMemoryError as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing at output allocation 1 of FSDP2 all-gather)
        >>> oom.calls_seen, oom.fired
        (2, 1)
    """
    all_gather, _ = _comm_classes()
    handle = OOMInjection("FSDP2 all-gather", "all-gather", _call_set(calls, "allocation"), _check_rank(rank))
    original = all_gather.allocate  # type: ignore[attr-defined]

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle._count_call("at output allocation")
        return original(self, *args, **kwargs)

    handle._handles.append(_MethodPatch(all_gather, "allocate", allocate))
    return handle


def inject_oom_in_reduce_scatter(*, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen allocations of an FSDP2 reduce-scatter's input buffer.

    FSDP2 allocates a reduce-scatter's input (the unsharded gradients, laid out for the
    collective) and then its output through the same ``allocate()``; only the inputs are
    counted, one per reduce-scatter (a module's backward), numbered from 0 over the handle's
    lifetime on each rank, and the chosen ones raise before anything is allocated. Only one
    injection of this kind can be active at a time.

    Args:
        calls: The reduce-scatter number, or numbers, to raise at (from 0). Default: the first.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> from elastic_batches.testing import inject_oom_in_reduce_scatter
        >>> oom = inject_oom_in_reduce_scatter(calls=[0, 2], rank=1)
        >>> oom.remove()
        >>> oom.calls_seen, oom.fired
        (0, 0)
    """
    _, reduce_scatter = _comm_classes()
    handle = OOMInjection("FSDP2 reduce-scatter", "reduce-scatter", _call_set(calls, "allocation"), _check_rank(rank))
    original = reduce_scatter.allocate  # type: ignore[attr-defined]
    input_next = [True]  # each reduce-scatter allocates its input, then its output

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if input_next[0]:
            handle._count_call("at input allocation")  # raises here: the next allocation is an input again
            input_next[0] = False
        else:
            input_next[0] = True
        return original(self, *args, **kwargs)

    handle._handles.append(_MethodPatch(reduce_scatter, "allocate", allocate))
    return handle


def inject_oom_in_stand_in(*, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen allocations of a stand-in's buffer (per-module FSDP2).

    Counts the calls of ``Script.buffers`` (one per failed scripted attempt: the buffers of the
    collectives the rank stands in for), numbered from 0 over the handle's lifetime on each rank,
    and raises at the chosen ones before anything is allocated: the rank cannot stand in, and its
    peers wait in the collective it does not start until the process group's timeout. Only one
    injection of this kind can be active at a time.

    Args:
        calls: The allocation number, or numbers, to raise at (from 0). Default: the first.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> from elastic_batches.distributed.script import Script
        >>> from elastic_batches.testing import inject_oom_in_stand_in
        >>> with inject_oom_in_stand_in() as oom:
        ...     try:
        ...         Script(()).buffers(0)
        ...     except Exception as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing at buffer allocation 0 of an FSDP2 stand-in)
        >>> oom.fired
        1
    """
    from elastic_batches.distributed.script import Script

    handle = OOMInjection("an FSDP2 stand-in", "stand-in", _call_set(calls, "allocation"), _check_rank(rank))
    original = Script.buffers

    def buffers(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle._count_call("at buffer allocation")
        return original(self, *args, **kwargs)

    handle._handles.append(_MethodPatch(Script, "buffers", buffers))
    return handle
