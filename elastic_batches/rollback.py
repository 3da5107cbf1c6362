"""What a step's forwards change besides ``.grad``, saved before its first attempt and put back after a failed one.

A retry must start from the state the step started from: the random generators (dropout then
draws the same numbers as a step that never failed) and the module buffers (BatchNorm's running
statistics, counters, caches). Saving every buffer at every step would copy large constant
buffers (a rotary or causal-mask cache) for nothing, so a buffer's data is copied only when
something may change it in place:

* the running statistics of a normalization layer in training mode, whose update inside the
  kernel does not bump the tensors' version counters;
* a buffer whose version counter moved in an earlier step (learned, then copied at every step);
* every buffer at the first step, when nothing is known yet (to host memory).

Every other buffer is remembered by its tensor object and version only: a forward that
reassigns it is undone by putting the old object back, and an in-place change is seen by its
version. Restoring copies into the existing tensors and allocates nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from elastic_batches._warnings import warn_once

__all__ = ["Rollback"]

logger = logging.getLogger(__name__)


class _Saved(NamedTuple):
    buffers: dict[str, Any]  # the module's ``_buffers``
    name: str
    tensor: torch.Tensor
    version: int
    copy: torch.Tensor | None  # the data before the step, when something may change it in place
    key: tuple[int, str]  # (id of the module, buffer name)


def _running_stats(module: nn.Module) -> bool:
    """Whether a forward of ``module`` updates its running statistics in place (without a version bump)."""
    return isinstance(module, _NormBase) and module.training and module.track_running_stats


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default random generator (the CPU's, or an accelerator's)."""
    if device.type == "cpu":
        return torch.default_generator.get_state()
    module = torch.get_device_module(device)
    return module.get_rng_state() if device.type == "mps" else module.get_rng_state(device)


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.default_generator.set_state(state)
        return
    module = torch.get_device_module(device)
    if device.type == "mps":
        module.set_rng_state(state)
    else:
        module.set_rng_state(state, device)


class Rollback:
    """Saves a model's buffers and the random generators before a step, and restores them after a failed attempt.

    Args:
        model: The module whose buffers a forward may change.

    Example:
        >>> import torch
        >>> from elastic_batches.rollback import Rollback
        >>> model = torch.nn.BatchNorm1d(2)
        >>> rollback = Rollback(model)
        >>> rollback.save([])
        >>> _ = model(torch.randn(4, 2)), torch.rand(1)
        >>> rollback.restore()
        >>> model.running_mean.tolist(), int(model.num_batches_tracked)
        ([0.0, 0.0], 0)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._mutable: set[tuple[int, str]] = set()  # buffers seen changing in place
        self._copies: dict[tuple[int, str], torch.Tensor] = {}  # kept between steps for those and running stats
        self._first = True
        self._saved: list[_Saved] = []
        self._generators: list[tuple[torch.device, torch.Tensor]] = []

    def save(self, devices: Iterable[torch.device]) -> None:
        """Remember the buffers, and the random generators of the CPU and of ``devices``, as they are now."""
        self._generators = [(device, _rng_state(device)) for device in {torch.device("cpu"), *devices}]
        saved: list[_Saved] = []
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        for module in self.model.modules():
            buffers = module._buffers
            if not buffers:
                continue
            stats = _running_stats(module)
            for name, tensor in buffers.items():
                if tensor is None:
                    continue
                key = (id(module), name)
                copy = None
                if stats or key in self._mutable:
                    copy = self._copies.get(key)
                    if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                        copy = self._copies[key] = torch.empty_like(tensor)
                    sources.append(tensor)
                    targets.append(copy)
                elif self._first:
                    copy = tensor.detach().to("cpu", copy=True)
                saved.append(_Saved(buffers, name, tensor, tensor._version, copy, key))
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
        self._saved = saved

    def restore(self) -> None:
        """Put back what :meth:`save` remembered: buffer objects, their data, the generators."""
        with torch.no_grad():
            for entry in self._saved:
                if entry.buffers.get(entry.name) is not entry.tensor:
                    entry.buffers[entry.name] = entry.tensor  # a forward reassigned it
                changed = entry.tensor._version != entry.version
                if entry.copy is not None and (changed or entry.key in self._copies):
                    entry.tensor.copy_(entry.copy)
                elif changed:
                    warn_once(
                        f"elastic_batches: a failed attempt changed a buffer {entry.name!r} of shape "
                        f"{tuple(entry.tensor.shape)} in place for the first time; it is saved before every step "
                        "from now on, but this once its change could not be undone",
                        stacklevel=4,
                    )
                if changed:
                    self._mutable.add(entry.key)
        for device, state in self._generators:
            _set_rng_state(device, state)

    def forget(self) -> None:
        """Drop what :meth:`save` remembered (a step that ended without going through)."""
        self._saved = []
        self._generators = []

    def commit(self) -> None:
        """After a step that went through: learn which buffers it changed in place, and forget the step."""
        for entry in self._saved:
            if entry.tensor._version != entry.version and entry.key not in self._mutable:
                self._mutable.add(entry.key)
                logger.debug("buffer %r changes in place: saved before every step from now on", entry.name)
        self._first = False
        self.forget()
