"""``MicrobatchingDataLoader``: a DataLoader whose batches can be cut into microbatches."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate, default_convert
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler

from elastic_batches._loader_state import check_loader_state
from elastic_batches._samplers import BUILT_BATCH_SAMPLERS, ResumableBatchSampler, ShuffleSampler, check_sampler_state
from elastic_batches._state import check_state_dict
from elastic_batches.batch import ElasticBatch
from elastic_batches.collate import ElasticCollate
from elastic_batches.controller import SplitController
from elastic_batches.variable_length.shape_buckets import ShapeBuckets

__all__ = ["MicrobatchingDataLoader"]

_STATE_VERSION = 1
_SNAPSHOT_EVERY_N_STEPS = 32  # workers' state sent every 32 batches, not every batch (torchdata's default)
_STATE_KEYS = frozenset({"version", "batch_size", "loader", "controller"})


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


def _accelerator_present() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


# What a DataLoader iterates with: a subclass that defines one of these has iteration of its own,
# which the rebuilt loader would lose; one that only sets arguments (PyG's sets collate_fn) is rebuilt.
_ITERATION_METHODS = ("__iter__", "_get_iterator", "__len__", "_index_sampler", "_auto_collation")
_STATE_METHODS = ("state_dict", "load_state_dict")


def _own_iteration(cls: type) -> str | None:
    """``"Class.method"`` of the first iteration method ``cls`` defines over DataLoader's, or ``None``."""
    base = StatefulDataLoader if issubclass(cls, StatefulDataLoader) else DataLoader
    for name in _ITERATION_METHODS + _STATE_METHODS:
        for klass in cls.__mro__:
            if klass is base:
                break
            if name in vars(klass):
                return f"{klass.__qualname__}.{name}"
    return None


def _arguments_of(loader: DataLoader) -> dict[str, Any]:
    """The constructor arguments that rebuild ``loader`` (without mutating it)."""
    if not isinstance(loader, MicrobatchingDataLoader):
        method = _own_iteration(type(loader))
        if method is not None:
            raise TypeError(
                f"MicrobatchingDataLoader cannot wrap a {type(loader).__qualname__}: it defines {method}, its own "
                "iteration logic, which the rebuilt loader would lose. Pass its dataset and arguments instead: "
                "MicrobatchingDataLoader(dataset, batch_size=..., collate_fn=..., ...)"
            )
    collate_fn: Callable[..., Any] | None = loader.collate_fn
    if collate_fn in (default_collate, default_convert):
        collate_fn = None
    arguments: dict[str, Any] = {
        "dataset": loader.dataset,
        "num_workers": loader.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": getattr(loader, "in_order", True),
    }
    if isinstance(loader, StatefulDataLoader):
        arguments["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    if isinstance(loader.dataset, IterableDataset):
        arguments.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_sampler is None:
        arguments.update(sampler=loader.sampler, batch_size=None)
    elif type(loader.batch_sampler) in BUILT_BATCH_SAMPLERS and loader.batch_size is not None:
        # what batch_size= builds (a batch_sampler= given by the user leaves batch_size None)
        arguments.update(sampler=loader.sampler, batch_size=loader.batch_size, drop_last=loader.drop_last)
    else:
        arguments.update(batch_sampler=loader.batch_sampler, batch_size=1, drop_last=False)
    return arguments


def _check_arguments(dataloader_kwargs: Mapping[str, Any]) -> None:
    """Refuse arguments neither ``MicrobatchingDataLoader`` nor ``StatefulDataLoader`` takes, naming the valid ones."""
    accepted = inspect.signature(StatefulDataLoader.__init__).parameters
    unknown = sorted(key for key in dataloader_kwargs if key not in accepted)
    if unknown:
        own = ["dataset", "batch_size", "controller", "pad_values", "sort_by_length", "shape_buckets"]
        others = [name for name in accepted if name not in ("self", *own)]
        raise TypeError(
            f"MicrobatchingDataLoader got unexpected keyword argument(s) {unknown}; its arguments are {own} and "
            f"those of StatefulDataLoader / DataLoader: {others}"
        )


class MicrobatchingDataLoader(StatefulDataLoader):
    """A DataLoader that yields :class:`ElasticBatch` objects tagged with the current split count.

    Give it an existing ``torch.utils.data.DataLoader`` or torchdata ``StatefulDataLoader``, or a
    subclass whose iteration is theirs (it is rebuilt from its arguments; the original is left
    untouched), or a dataset and the usual
    DataLoader arguments. It *is* a ``StatefulDataLoader``: ``len()``, workers, samplers,
    Lightning's ``DistributedSampler`` injection and mid-epoch ``state_dict()`` work as usual.

    Each batch is collated as the plain loader would (the same ``collate_fn``), crosses from the
    worker as the plain loader's batch would, and is tagged in the main process, when it is
    yielded, with the count its :class:`SplitController` holds for its size. It is taken apart
    into row-splittable fields when the step first cuts it (a batch that runs whole never is);
    the first batch of each epoch is taken apart at once, so that a structure that cannot be
    split fails before training.

    Args:
        dataset: A dataset, or a ``DataLoader`` / ``StatefulDataLoader`` to wrap.
        batch_size: Rows per batch (the batch you want to optimise with). When wrapping a
            loader, defaults to the loader's.
        controller: The :class:`SplitController` shared with the step side; a new one by default
            (or the wrapped ``MicrobatchingDataLoader``'s).
        pad_values: Field name -> pad value for the per-sample fields whose first dimension
            varies (``{"input_ids": 0, "labels": -100}``). Samples must be mappings; each batch is
            padded to its longest sample in the worker, and each microbatch is cut to its own
            longest sample. Kept as the attribute ``pad_values``. See ``docs/variable_length.md``.
        sort_by_length: With ``pad_values``, sort each batch's samples longest first so that
            microbatches group similar lengths (default ``True``; the wrapped loader's setting
            when wrapping a ``MicrobatchingDataLoader``).
        shape_buckets: With ``pad_values``, a :class:`ShapeBuckets` that rounds microbatch
            shapes up so a ``torch.compile``d model recompiles a bounded number of times.
        **dataloader_kwargs: Any other ``DataLoader`` / ``StatefulDataLoader`` argument; when
            wrapping a loader they override its own. ``pin_memory=True`` is ignored when no
            accelerator is present (pinning needs one). ``snapshot_every_n_steps`` defaults to
            32 unless a ``StatefulDataLoader`` is wrapped (torchdata's default is 1): with
            workers, every snapshot brings the workers' state to the main process; a mid-epoch
            resume then loads up to 31 batches again to reach its place.

    Raises:
        TypeError: ``dataset`` is a DataLoader subclass that defines iteration of its own
            (``__iter__``, ``_get_iterator``, ``__len__``, ``state_dict``...; the message names
            it). A subclass that only sets arguments, such as PyG's ``DataLoader`` (it sets
            ``collate_fn``), is rebuilt from them.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import elastic_batches as eb
        >>> plain = DataLoader(TensorDataset(torch.randn(20, 3), torch.arange(20)), batch_size=8)
        >>> loader = eb.MicrobatchingDataLoader(plain, controller=eb.SplitController(split_count=2))
        >>> batch = next(iter(loader))
        >>> len(loader), len(batch), batch.split_count
        (3, 8, 2)
        >>> [len(mb) for mb in batch.microbatches()]
        [4, 4]
        >>> texts = [{"ids": torch.arange(n), "text": "ab"[: n % 3]} for n in (2, 5, 3, 9)]
        >>> loader = eb.MicrobatchingDataLoader(texts, batch_size=4, pad_values={"ids": 0})
        >>> [tuple(mb.unwrap()["ids"].shape) for mb in next(iter(loader)).microbatches(2)]
        [(2, 9), (2, 3)]
    """

    pad_values: dict[Any, bool | int | float] | None
    sort_by_length: bool
    shape_buckets: ShapeBuckets | None

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = _UNSET,
        *,
        controller: SplitController | None = None,
        pad_values: Mapping[Any, bool | int | float] | None = None,
        sort_by_length: bool = _UNSET,
        shape_buckets: ShapeBuckets | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        _check_arguments(dataloader_kwargs)
        if isinstance(dataset, MicrobatchingDataLoader):
            pad_values = dataset.pad_values if pad_values is None else pad_values
            sort_by_length = dataset.sort_by_length if sort_by_length is _UNSET else sort_by_length
            shape_buckets = dataset.shape_buckets if shape_buckets is None else shape_buckets
        if isinstance(dataset, DataLoader):
            if controller is None and isinstance(dataset, MicrobatchingDataLoader):
                controller = dataset.controller
            arguments = _arguments_of(dataset)
        else:
            arguments = {"dataset": dataset, "batch_size": 1}
        if batch_size is not _UNSET:
            arguments["batch_size"] = batch_size
        if "sampler" in dataloader_kwargs or "batch_sampler" in dataloader_kwargs or "shuffle" in dataloader_kwargs:
            for key in ("sampler", "batch_sampler"):
                arguments.pop(key, None)
            if dataloader_kwargs.get("batch_sampler") is not None:
                arguments.pop("batch_size", None)
                arguments.pop("drop_last", None)
        if not isinstance(dataset, StatefulDataLoader):
            arguments["snapshot_every_n_steps"] = _SNAPSHOT_EVERY_N_STEPS
        arguments.update(dataloader_kwargs)
        if arguments.pop("shuffle", None) and not isinstance(arguments["dataset"], IterableDataset):
            if arguments.get("sampler") is not None or arguments.get("batch_sampler") is not None:
                raise ValueError(
                    "MicrobatchingDataLoader: shuffle=True cannot be combined with a sampler or batch_sampler"
                )
            arguments["sampler"] = ShuffleSampler(arguments["dataset"], generator=arguments.get("generator"))
        if arguments.get("pin_memory") and not _accelerator_present():
            arguments["pin_memory"] = False
        if controller is not None and not isinstance(controller, SplitController):
            raise TypeError(
                f"MicrobatchingDataLoader: controller must be an elastic_batches.SplitController, got {controller!r}"
            )
        auto_collation = arguments.get("batch_size", 1) is not None or arguments.get("batch_sampler") is not None
        arguments["collate_fn"] = ElasticCollate(
            arguments.get("collate_fn"),
            auto_collation=auto_collation,
            pad_values=pad_values,
            sort_by_length=True if sort_by_length is _UNSET else sort_by_length,
            shape_buckets=shape_buckets,
        )
        self.controller: SplitController = controller if controller is not None else SplitController()
        self.pad_values = arguments["collate_fn"].pad_values
        self.sort_by_length = arguments["collate_fn"].sort_by_length
        self.shape_buckets = shape_buckets
        with warnings.catch_warnings():  # torchdata's constructor calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(**arguments)
        if type(self.batch_sampler) is StatefulBatchSampler:  # built just now from batch_size; not settable after
            self.batch_sampler.__class__ = ResumableBatchSampler

    def __iter__(self) -> Iterator[ElasticBatch]:  # type: ignore[override]
        return self._tagged(super().__iter__())

    def _tagged(self, batches: Iterator[ElasticBatch]) -> Iterator[ElasticBatch]:
        controller = self.controller
        checked = False
        for batch in batches:
            batch.tag(controller.settled)  # the count of now, worked out when first read
            if not checked:  # a batch that cannot be split, or counted in the controller's unit, fails here
                batch.fields  # noqa: B018 - takes a deferred batch apart
                batch.split_count  # noqa: B018 - works the count out
                checked = True
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch (inner loader) and what the controller learned."""
        return {
            "version": _STATE_VERSION,
            "batch_size": self.batch_size,
            "loader": super().state_dict(),
            "controller": self.controller.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: the next ``iter()`` resumes where it was saved.

        The controller learned microbatch sizes, which hold for any batch size; the position in
        the epoch does not, so a state saved with another ``batch_size`` is refused.

        Every part is checked before any is applied: a state that would fail at the next
        ``iter()`` is refused here, and the loader and its controller are then unchanged.

        Raises:
            ValueError: keys are missing or unexpected, the version is unknown, the state was
                saved by a loader with another ``batch_size`` or ``num_workers``, or a part of it
                is not what a ``state_dict()`` writes (the message names it).
        """
        check_state_dict("MicrobatchingDataLoader", state_dict, _STATE_KEYS, _STATE_VERSION)
        check_loader_state(state_dict["loader"], self.num_workers)
        check_sampler_state(self.batch_sampler, state_dict["loader"])
        if state_dict["batch_size"] != self.batch_size:
            raise ValueError(
                f"MicrobatchingDataLoader.load_state_dict: the state was saved with batch_size="
                f"{state_dict['batch_size']}, this loader has batch_size={self.batch_size}: its position in the "
                "epoch would be wrong. Resume with the same batch_size, or load only the controller's state: "
                "loader.controller.load_state_dict(state['controller'])"
            )
        self.controller.load_state_dict(state_dict["controller"])  # checks all its fields before it applies any
        super().load_state_dict(state_dict["loader"])
