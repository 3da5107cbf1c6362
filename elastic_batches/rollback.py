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
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from elastic_batches._warnings import warn_once
from elastic_batches.oom import is_oom_error

__all__ = ["Rollback"]

logger = logging.getLogger(__name__)


# One buffer as saved: its module's ``_buffers``, its name, the tensor, its version, its data before the
# step when something may change it (a copy kept between steps, or at the first step one in host memory),
# and whether that copy is put back whatever the version says (running statistics).
_Saved = tuple[dict[str, Any], str, torch.Tensor, int, "torch.Tensor | None", bool]


def _modules_of(model: nn.Module) -> list[nn.Module]:
    """``model`` and its submodules, each once (``model.modules()``'s set, walked without its generators)."""
    found, seen, index = [model], {id(model)}, 0
    while index < len(found):
        for child in found[index]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
        index += 1
    return found


def _running_stats(module: nn.Module) -> bool:
    """Whether a forward of ``module`` updates its running statistics in place (without a version bump)."""
    return isinstance(module, _NormBase) and module.training and module.track_running_stats


def _rng_module(device: torch.device) -> Any:
    """The module holding ``device``'s default random generator, or ``None`` for a device without one (meta)."""
    try:
        module = torch.get_device_module(device)
    except (RuntimeError, AttributeError):  # "Device 'meta' does not have a corresponding module"
        return None
    return module if callable(getattr(module, "get_rng_state", None)) else None


def _rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of ``device``'s default random generator (the CPU's, or an accelerator's); ``None`` if it has none."""
    if device.type == "cpu":
        return torch.default_generator.get_state()
    module = _rng_module(device)
    if module is None:
        return None
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


class _LazyState:
    """A lazy module (``nn.LazyLinear``...) not yet initialised, as it was: undone if a failed attempt initialised it.

    Its initialisation drew random numbers; undone, the retry initialises it again from the
    rewound generators, and draws what a direct run draws.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cls = type(module)
        self.attributes = dict(module.__dict__)  # in_features and the hooks' handles among them
        self.tensors = [
            (tensor, type(tensor), tensor.data)
            for tensor in (*module._parameters.values(), *module._buffers.values())
            if isinstance(tensor, UninitializedTensorMixin)
        ]

    def undo(self) -> None:
        module: Any = self.module
        if type(module) is self.cls and all(isinstance(t, UninitializedTensorMixin) for t, _, _ in self.tensors):
            return  # still uninitialised: nothing to undo
        for tensor, cls, data in self.tensors:
            tensor.data = data
            tensor.__class__ = cls
        module.__class__ = self.cls
        module.__dict__.clear()
        module.__dict__.update(self.attributes)
        module._load_hook = module._register_load_state_dict_pre_hook(module._lazy_load_hook)
        module._initialize_hook = module.register_forward_pre_hook(
            module._infer_parameters, with_kwargs=True, prepend=True
        )


class Rollback:
    """Saves a model's buffers and the random generators before a step, and restores them after a failed attempt.

    Args:
        model: The module whose buffers a forward may change.

    Example:
        >>> import torch
        >>> from elastic_batches.rollback import Rollback
        >>> model = torch.nn.BatchNorm1d(2)
        >>> rollback = Rollback(model)
        >>> rollback.save([torch.device("cpu")])
        >>> _ = model(torch.randn(4, 2)), torch.rand(1)
        >>> rollback.restore()
        >>> model.running_mean.tolist(), int(model.num_batches_tracked)
        ([0.0, 0.0], 0)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._mutable: set[int] = set()  # ids of buffer tensors seen changing in place
        self._copies: dict[int, torch.Tensor] = {}  # by buffer id: kept between steps for those and running stats
        self._first = True
        self._saved: list[_Saved] = []
        self._generators: list[tuple[torch.device, torch.Tensor]] = []
        self._counts: list[tuple[nn.Module, int, int, int]] = []  # per module: buffers, parameters, submodules
        self._lazy: list[_LazyState] = []

    def save(self, devices: Iterable[torch.device]) -> None:
        """Remember the buffers, and the random generators of ``devices`` (the CPU's among them), as they are now."""
        states = [(device, _rng_state(device)) for device in devices]
        self._generators = [(device, state) for device, state in states if state is not None]
        saved: list[_Saved] = []
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        mutable, copies, first = self._mutable, self._copies, self._first
        modules = _modules_of(self.model)
        self._counts = [(m, len(m._buffers), len(m._parameters), len(m._modules)) for m in modules]
        self._lazy = [_LazyState(m) for m in modules if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]
        for module in modules:
            buffers = module._buffers
            if not buffers:
                continue
            stats = _running_stats(module)
            for name, tensor in buffers.items():
                if tensor is None:
                    continue
                copy = None
                key = id(tensor)
                if stats or key in mutable:
                    copy = copies.get(key)
                    if copy is None:
                        copy = copies[key] = torch.empty_like(tensor)
                    sources.append(tensor)
                    targets.append(copy)
                elif first:
                    copy = tensor.detach().to("cpu", copy=True)
                saved.append((buffers, name, tensor, tensor._version, copy, stats))
        if targets and not self._copy(targets, sources):
            saved = [(*entry[:4], copies.get(id(entry[2]), entry[4]), entry[5]) for entry in saved]
        self._saved = saved

    def _copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> bool:
        """Copy ``sources`` into the kept ``targets``; ``False`` when a buffer resized in place got a new copy."""
        with torch.no_grad():
            try:
                torch._foreach_copy_(targets, sources)
                return True
            except RuntimeError as err:
                if is_oom_error(err):
                    raise
            for index, (target, source) in enumerate(zip(targets, sources, strict=True)):
                if target.shape != source.shape:
                    targets[index] = self._copies[id(source)] = torch.empty_like(source)
            torch._foreach_copy_(targets, sources)
            return False

    def restore(self) -> None:
        """Put back what :meth:`save` remembered: buffer objects, their data, the generators.

        Buffers, parameters and submodules registered since (a module that registers state on
        its first forward) are removed, and lazy modules initialised since are uninitialised.
        """
        for lazy in self._lazy:
            lazy.undo()
        for module, buffers_count, params_count, modules_count in self._counts:
            for registry, count in (
                (module._buffers, buffers_count),
                (module._parameters, params_count),
                (module._modules, modules_count),
            ):
                for name in list(registry)[count:]:  # names are kept in registration order: the new ones are last
                    del registry[name]
        with torch.no_grad():
            for buffers, name, tensor, version, copy, always in self._saved:
                if buffers.get(name) is not tensor:
                    buffers[name] = tensor  # a forward reassigned it
                changed = tensor._version != version
                if copy is not None and (changed or always):  # running statistics change without a version bump
                    tensor.copy_(copy)
                elif changed:
                    warn_once(
                        f"elastic_batches: a failed attempt changed a buffer {name!r} of shape "
                        f"{tuple(tensor.shape)} in place for the first time; it is saved before every step "
                        "from now on, but this once its change could not be undone",
                        stacklevel=4,
                    )
                if changed:
                    self._mutable.add(id(tensor))
        for device, state in self._generators:
            _set_rng_state(device, state)

    def forget(self) -> None:
        """Drop what :meth:`save` remembered (a step that ended without going through)."""
        self._saved = []
        self._generators = []
        self._counts = []
        self._lazy = []

    def commit(self) -> None:
        """After a step that went through: learn which buffers it changed in place, and forget the step."""
        for _, name, tensor, version, _, _ in self._saved:
            if tensor._version != version and id(tensor) not in self._mutable:
                self._mutable.add(id(tensor))
                logger.debug("buffer %r changes in place: saved before every step from now on", name)
        self._first = False
        self.forget()
