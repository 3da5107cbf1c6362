"""User-facing warnings: once per process, on rank zero only."""

from __future__ import annotations

import warnings

import torch.distributed as dist

__all__ = ["warn_on_rank_zero", "warn_once"]

_WARNED: set[str] = set()


def warn_on_rank_zero(message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 2) -> None:
    """Warn with ``message`` on rank zero only (every process when no process group is initialized).

    Args:
        message: The warning's text.
        category: The warning class.
        stacklevel: Which frame the warning names, counted from the one that calls this
            function (1); the default, 2, is the caller of that function.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def warn_once(message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 2) -> None:
    """Warn with ``message`` the first time it is given in this process, and only on rank zero.

    Args:
        message: The warning's text; the same text is never warned twice.
        category: The warning class.
        stacklevel: As for :func:`warn_on_rank_zero`.

    Example:
        >>> import warnings
        >>> from elastic_batches._warnings import warn_once
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(3):
        ...         warn_once("elastic_batches: shown once (doctest)")
        >>> len(caught)
        1
    """
    if message in _WARNED:
        return
    _WARNED.add(message)
    warn_on_rank_zero(message, category, stacklevel=stacklevel + 1)
