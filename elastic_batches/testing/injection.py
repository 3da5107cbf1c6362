"""OOM injection at a chosen phase, call or rank (forward, backward, optimizer step, device transfer, cut, any op)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NoReturn

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from elastic_batches._state import is_int

__all__ = [
    "OOMInjection",
    "inject_oom",
    "inject_oom_in_cut",
    "inject_oom_in_op",
    "inject_oom_in_optimizer",
    "inject_oom_in_transfer",
]

_PHASES = ("forward", "backward")


def _current_rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _call_set(calls: int | Iterable[int], what: str) -> frozenset[int]:
    values: list[object] = list(calls) if isinstance(calls, Iterable) else [calls]
    for value in values:
        if not is_int(value, integral=True):
            raise TypeError(f"calls must hold int {what} numbers, got {value!r}: pass e.g. calls=0 or calls=[0, 2]")
        if value < 0:
            raise ValueError(
                f"calls must hold {what} numbers >= 0 (counted from 0), got {value}: pass e.g. calls=0 or calls=[0, 2]"
            )
    if not values:
        raise ValueError(f"calls is empty: pass at least one {what} number to raise at, e.g. calls=0")
    return frozenset(int(v) for v in values)  # type: ignore[call-overload]


def _check_rank(rank: int | None) -> int | None:
    if rank is None:
        return None
    if not is_int(rank, integral=True) or rank < 0:
        raise ValueError(f"rank must be a torch.distributed rank >= 0 or None (every rank), got {rank!r}")
    return int(rank)


class OOMInjection:
    """Handle of an injected OOM, returned by :func:`inject_oom` and :func:`inject_oom_in_optimizer`.

    Use it as a context manager, or call :meth:`remove`, to take the hooks out again.

    Attributes:
        calls_seen: Calls counted so far (forward calls of the module, or optimizer steps),
            on every rank, whether or not they raised.
        fired: How many times this injection raised :class:`torch.OutOfMemoryError`.

    Example:
        >>> import torch
        >>> from elastic_batches.testing import inject_oom
        >>> model = torch.nn.Linear(2, 2)
        >>> with inject_oom(model, phase="forward", calls=1) as oom:
        ...     _ = model(torch.ones(1, 2))  # call 0 runs
        ...     try:
        ...         _ = model(torch.ones(1, 2))  # call 1 raises
        ...     except torch.OutOfMemoryError as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing at forward call 1 of Linear)
        >>> oom.calls_seen, oom.fired
        (2, 1)
    """

    def __init__(self, target: str, phase: str, calls: frozenset[int], rank: int | None) -> None:
        self.calls_seen = 0
        self.fired = 0
        self._target = target
        self._phase = phase
        self._calls = calls
        self._rank = rank
        self._removed = False
        self._handles: list[Any] = []

    def _armed(self, index: int) -> bool:
        return not self._removed and index in self._calls and (self._rank is None or _current_rank() == self._rank)

    def _count_call(self, where: str) -> None:
        """Number this call; raise if it is one of the chosen ones (``where`` names it, e.g. "at optimizer step")."""
        index = self.calls_seen
        self.calls_seen += 1
        if self._armed(index):
            self._fire(f"{where} {index}")

    def _fire(self, where: str) -> NoReturn:
        self.fired += 1
        rank = "" if self._rank is None else f" on rank {self._rank}"
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by elastic_batches.testing {where} of {self._target}{rank})"
        )

    def remove(self) -> None:
        """Removes the hooks; a pending backward injection no longer fires. Safe to call twice.

        Example:
            >>> model = torch.nn.Linear(2, 2)
            >>> oom = inject_oom(model, phase="forward")
            >>> oom.remove()
            >>> _ = model(torch.ones(1, 2))  # no longer raises
            >>> oom.calls_seen
            0
        """
        self._removed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> OOMInjection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"OOMInjection({self._target}, phase={self._phase!r}, calls={sorted(self._calls)}, rank={self._rank}, "
            f"calls_seen={self.calls_seen}, fired={self.fired})"
        )


def inject_oom(
    module: nn.Module,
    *,
    phase: Literal["forward", "backward"],
    calls: int | Iterable[int] = 0,
    rank: int | None = None,
) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen forward calls of ``module``, or in their backward.

    Forward calls of ``module`` are numbered from 0 over the handle's lifetime, one number per
    call: when a step runs ``k`` microbatches through the model, call ``i`` is microbatch ``i``
    of the first step, and call ``k`` the first microbatch of the retry or of the next step.

    * ``phase="forward"`` raises at the start of the chosen calls, before the module runs.
    * ``phase="backward"`` lets the chosen calls run, and raises when backward reaches the
      gradient of their output (a hook on each output tensor that requires grad). Pass a
      submodule, such as the first layer, to strike after later layers already received their
      gradients: the partial-backward case. A call whose outputs do not require grad (under
      ``torch.no_grad``) never raises.

    Args:
        module: The module whose forward calls are counted.
        phase: ``"forward"`` or ``"backward"``.
        calls: The call number, or numbers, to raise at (from 0). Default: the first call.
        rank: Raise only on this ``torch.distributed`` rank; the others count calls but never
            raise. ``None`` (default) raises on every rank. Without an initialized process group
            the process is rank 0.

    Returns:
        An :class:`OOMInjection` handle: a context manager with ``remove()``, ``fired`` and
        ``calls_seen``.

    Raises:
        ValueError: If ``phase`` is unknown, or ``calls`` or ``rank`` is negative or empty.
        TypeError: If ``module`` is not an ``nn.Module`` or ``calls`` holds non-integers.

    Example:
        >>> import torch
        >>> from elastic_batches.testing import inject_oom
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> with inject_oom(model[0], phase="backward", calls=0) as oom:
        ...     loss = model(torch.ones(3, 2)).sum()  # forward runs
        ...     try:
        ...         loss.backward()
        ...     except torch.OutOfMemoryError as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing in backward of forward call 0 of Linear)
        >>> model[1].weight.grad is not None, model[0].weight.grad is None  # partial backward
        (True, True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"inject_oom needs an nn.Module, got {type(module).__name__}: "
            "pass the model or the submodule whose forward should run out of memory"
        )
    if phase not in _PHASES:
        raise ValueError(f"unknown phase {phase!r}: use phase='forward' or phase='backward'")
    handle = OOMInjection(type(module).__name__, phase, _call_set(calls, "forward call"), _check_rank(rank))

    if phase == "forward":

        def pre_hook(mod: nn.Module, args: Any) -> None:
            handle._count_call("at forward call")

        handle._handles.append(module.register_forward_pre_hook(pre_hook))
        return handle

    pending: list[int] = []  # call numbers between the pre-hook and the forward hook (recursion-safe)

    def count_hook(mod: nn.Module, args: Any) -> None:
        pending.append(handle.calls_seen)
        handle.calls_seen += 1

    def arm_hook(mod: nn.Module, args: Any, output: Any) -> None:
        index = pending.pop() if pending else handle.calls_seen - 1
        if output is None or not handle._armed(index):
            return
        armed = [True]  # one raise per forward call, whichever output's gradient comes first

        def grad_hook(grad: torch.Tensor) -> None:
            if armed[0] and not handle._removed:
                armed[0] = False
                handle._fire(f"in backward of forward call {index}")

        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(grad_hook)

    handle._handles.append(module.register_forward_pre_hook(count_hook))
    handle._handles.append(module.register_forward_hook(arm_hook, always_call=True))
    return handle


def inject_oom_in_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    calls: int | Iterable[int] = 0,
    rank: int | None = None,
) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` at the start of chosen ``optimizer.step()`` calls.

    Steps are numbered from 0 over the handle's lifetime. The raise happens in a step pre-hook,
    before any parameter is touched. Splitting a batch cannot cure such an OOM, so this is the
    tool for testing that the library re-raises it clearly instead of retrying.

    Args:
        optimizer: The optimizer whose ``step`` calls are counted.
        calls: The step number, or numbers, to raise at (from 0). Default: the first step.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.
            Without an initialized process group the process is rank 0.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.
        TypeError: If ``optimizer`` is not a ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> from elastic_batches.testing import inject_oom_in_optimizer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> with inject_oom_in_optimizer(opt, calls=0):
        ...     try:
        ...         opt.step()
        ...     except torch.OutOfMemoryError as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing at optimizer step 0 of SGD)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"inject_oom_in_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}: "
            "pass the optimizer whose step() should run out of memory"
        )
    handle = OOMInjection(type(optimizer).__name__, "step", _call_set(calls, "optimizer step"), _check_rank(rank))

    def pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle._count_call("at optimizer step")

    handle._handles.append(optimizer.register_step_pre_hook(pre_hook))
    return handle


class _MethodPatch:
    """Puts a replacement method on a class until :meth:`remove` (an ``OOMInjection`` handle entry).

    A method the class inherits is shadowed, and the shadow deleted on removal.
    """

    def __init__(self, cls: type, name: str, replacement: Any) -> None:
        self._cls, self._name, self._own = cls, name, cls.__dict__.get(name)
        setattr(cls, name, replacement)

    def remove(self) -> None:
        if self._own is None:
            delattr(self._cls, self._name)
        else:
            setattr(self._cls, self._name, self._own)


def inject_oom_in_transfer(*, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen device transfers of a microbatch.

    Counts the calls of ``Microbatch.to`` — what ``ElasticStep(device=...)`` does just before each
    microbatch's forward — numbered from 0 over the handle's lifetime, and raises at the chosen
    ones before anything is copied. Only one injection of this kind can be active at a time.

    Args:
        calls: The transfer number, or numbers, to raise at (from 0). Default: the first transfer.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> from elastic_batches.testing import inject_oom_in_transfer
        >>> model = torch.nn.Linear(2, 1)
        >>> step = eb.ElasticStep(model, device="cpu")
        >>> batch = (torch.randn(8, 2), torch.randn(8, 1))
        >>> with inject_oom_in_transfer(calls=0) as oom:
        ...     _ = step.backward(batch, lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]))
        >>> oom.fired, step.controller.split_count
        (1, 2)
    """
    from elastic_batches.batch import Microbatch

    return _inject_in_method(Microbatch, "to", "transfer", "device transfer", calls, rank)


def _inject_in_method(
    cls: type, name: str, phase: str, what: str, calls: int | Iterable[int], rank: int | None
) -> OOMInjection:
    """An injection that counts the calls of method ``cls.name`` (each a ``what``) and raises at the chosen ones."""
    handle = OOMInjection(cls.__name__, phase, _call_set(calls, what), _check_rank(rank))
    original = cls.__dict__[name]

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle._count_call(f"at {what}")
        return original(self, *args, **kwargs)

    handle._handles.append(_MethodPatch(cls, name, counted))
    return handle


def inject_oom_in_cut(*, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen cuts of a padded microbatch.

    Counts the calls of ``Padding.piece`` — what cutting a padded batch (a loader with
    ``pad_values``) into microbatches does for each microbatch: slicing, trimming to its longest
    sample and copying, which allocates on the batch's device — numbered from 0 over the
    handle's lifetime, and raises at the chosen ones before anything is cut. Only one injection
    of this kind can be active at a time.

    Args:
        calls: The cut number, or numbers, to raise at (from 0). Default: the first cut.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> from elastic_batches.testing import inject_oom_in_cut
        >>> samples = [{"ids": torch.ones(n, dtype=torch.long)} for n in (2, 7, 3, 5)]
        >>> batch = eb.ElasticCollate(pad_values={"ids": 0})(samples)
        >>> step = eb.ElasticStep(torch.nn.Embedding(2, 1), controller=eb.SplitController(split_count=2))
        >>> with inject_oom_in_cut(calls=1) as oom:
        ...     _ = step.backward(batch, lambda mb: step.model(mb["ids"]).mean())
        >>> oom.fired, step.controller.split_count
        (1, 4)
    """
    from elastic_batches.variable_length.padding import Padding

    return _inject_in_method(Padding, "piece", "cut", "cut", calls, rank)


class _OpMode(TorchDispatchMode):
    """Counts the calls of one aten op and hands each to its injection."""

    def __init__(self, packet: Any, count: Callable[[], None]) -> None:
        super().__init__()
        self._packet, self._count = packet, count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is self._packet:
            self._count()
        return func(*args, **(kwargs or {}))


class _ModeExit:
    """Leaves a dispatch mode entered by an injection (an ``OOMInjection`` handle entry)."""

    def __init__(self, mode: TorchDispatchMode) -> None:
        self._mode = mode
        mode.__enter__()

    def remove(self) -> None:
        self._mode.__exit__(None, None, None)


def inject_oom_in_op(op: Any, *, calls: int | Iterable[int] = 0, rank: int | None = None) -> OOMInjection:
    """Raises :class:`torch.OutOfMemoryError` in chosen calls of one aten operator, as its allocation would.

    While the handle is active (a dispatch mode, entered when the handle is made: use it as a
    context manager), the calls of ``op`` on this thread are numbered from 0, whatever their
    overload, and the chosen ones raise before they run. It reaches what no module hook does:
    the ``aten.cat`` of padding, the ``aten.stack`` of losses, the ``aten.empty`` of a
    collective's buffer.

    Args:
        op: The operator, as ``torch.ops.aten.stack`` (or one overload of it, as
            ``torch.ops.aten.stack.default``).
        calls: The call number, or numbers, to raise at (from 0). Default: the first call.
        rank: Raise only on this ``torch.distributed`` rank; ``None`` (default) on every rank.

    Returns:
        An :class:`OOMInjection` handle (context manager, ``remove()``, ``fired``, ``calls_seen``).

    Raises:
        TypeError: ``op`` is not an aten operator.
        ValueError: If ``calls`` or ``rank`` is negative or ``calls`` is empty.

    Example:
        >>> import torch
        >>> from elastic_batches.testing import inject_oom_in_op
        >>> with inject_oom_in_op(torch.ops.aten.cat, calls=1) as oom:
        ...     _ = torch.cat([torch.ones(2), torch.ones(2)])  # call 0 runs
        ...     try:
        ...         _ = torch.cat([torch.ones(2), torch.ones(2)])
        ...     except torch.OutOfMemoryError as err:
        ...         print(err)
        CUDA out of memory (injected by elastic_batches.testing at call 1 of aten.cat)
    """
    packet = getattr(op, "overloadpacket", op)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise TypeError(
            f"inject_oom_in_op needs an aten operator such as torch.ops.aten.cat, got {op!r}: pass the operator "
            "whose allocation should run out of memory"
        )
    handle = OOMInjection(str(packet), "op", _call_set(calls, "op call"), _check_rank(rank))
    handle._handles.append(_ModeExit(_OpMode(packet, lambda: handle._count_call("at call"))))
    return handle
