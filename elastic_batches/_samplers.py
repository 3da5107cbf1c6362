"""The samplers ``MicrobatchingDataLoader(batch_size=...)`` builds: resumable, and a batch's indices at a time.

torchdata's ``StatefulDataLoader`` makes the position in an epoch resumable, but its samplers
hand out one index per Python call. These keep torchdata's state keys (a state saved by one loads
into the other) and take a batch's indices in one slice. :func:`check_sampler_state` refuses a
saved position they could not resume from, before anything is loaded.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler
from torch.utils.data.dataloader import _InfiniteConstantSampler
from torchdata.stateful_dataloader import Stateful
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from elastic_batches._state import is_int

__all__ = ["BUILT_BATCH_SAMPLERS", "ResumableBatchSampler", "ShuffleSampler", "check_sampler_state"]


class ShuffleSampler(StatefulRandomSampler, RandomSampler):
    """torchdata's resumable random sampler that is also a ``torch.utils.data.RandomSampler``.

    What ``shuffle=True`` builds: Lightning recognises it as the default shuffling sampler and
    swaps in a shuffling ``DistributedSampler`` under DDP, as it does for a plain DataLoader.
    Built with the defaults only (no replacement, one pass over the dataset), so that an epoch's
    indices come from :class:`ShuffledOrder`: torchdata's order and state, a batch at a time.
    """

    def __iter__(self) -> Iterator[int]:
        return ShuffledOrder(self)


class ShuffledOrder:
    """One epoch of a :class:`ShuffleSampler`: torchdata's order and state keys, taken a batch at a time.

    torchdata's iterator returns one index per Python call; :meth:`take` slices a batch's indices
    from the permutation at once.
    """

    def __init__(self, sampler: ShuffleSampler) -> None:
        self.generator = sampler.generator
        self.size = len(sampler.data_source)
        self._start(self.generator.get_state())

    def _start(self, generator_state: torch.Tensor) -> None:
        """Draw the epoch's permutation from ``generator_state``, as torchdata does."""
        self.generator_state = generator_state
        self.generator.set_state(generator_state)
        self.permutation = torch.randperm(self.size, generator=self.generator).tolist()
        self.yielded = 0

    def take(self, n: int) -> list[int]:
        """The next ``n`` indices (fewer at the end of the epoch; none after it)."""
        start = self.yielded
        self.yielded = min(start + n, self.size)
        return self.permutation[start : self.yielded]

    def __iter__(self) -> ShuffledOrder:
        return self

    def __next__(self) -> int:
        if self.yielded == self.size:
            raise StopIteration
        self.yielded += 1
        return self.permutation[self.yielded - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "generator": self.generator_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._start(state["generator"])
        self.yielded = state["yielded"]


class ResumableBatches:
    """The batches of index lists a batch sampler yields, resumable as torchdata's are (same state keys).

    torchdata's iterator appends the indices one Python call at a time; this one takes each
    batch's indices from the sampler in one ``islice`` (from a :class:`ShuffledOrder`, in one
    slice).
    """

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.sampler_iter = iter(sampler)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.samples_yielded = 0

    def __iter__(self) -> ResumableBatches:
        return self

    def __next__(self) -> list[int]:
        order = self.sampler_iter
        if type(order) is ShuffledOrder:
            batch = order.take(self.batch_size)
        else:
            batch = list(itertools.islice(order, self.batch_size))
        self.samples_yielded += len(batch)
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"samples_yielded": self.samples_yielded}
        if isinstance(self.sampler, Stateful):
            state["sampler_state"] = self.sampler.state_dict()
        if isinstance(self.sampler_iter, Stateful):
            state["sampler_iter_state"] = self.sampler_iter.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_yielded = state["samples_yielded"]
        if "sampler_state" in state:
            self.sampler.load_state_dict(state["sampler_state"])
        self.sampler_iter = iter(self.sampler)
        if "sampler_iter_state" in state:
            self.sampler_iter.load_state_dict(state["sampler_iter_state"])
        if not isinstance(self.sampler, (Stateful, _InfiniteConstantSampler)) and not isinstance(
            self.sampler_iter, Stateful
        ):  # a sampler without state of its own: skip what was yielded
            next(itertools.islice(self.sampler_iter, self.samples_yielded, self.samples_yielded), None)


class ResumableBatchSampler(StatefulBatchSampler):
    """What ``batch_size=`` builds in a ``StatefulDataLoader``, iterated by :class:`ResumableBatches`."""

    def __iter__(self) -> Iterator[list[int]]:
        return ResumableBatches(self.sampler, self.batch_size, self.drop_last)


# what batch_size= builds in a DataLoader, a StatefulDataLoader and a MicrobatchingDataLoader
BUILT_BATCH_SAMPLERS = (BatchSampler, StatefulBatchSampler, ResumableBatchSampler)


def check_sampler_state(batch_sampler: Any, state: Mapping[str, Any]) -> None:
    """Refuse a loader state (``state_dict()["loader"]``) that ``batch_sampler`` could not resume from.

    Only a :class:`ResumableBatchSampler` (what ``batch_size=`` builds) is checked: other samplers' states are
    their own.
    """
    if not state or type(batch_sampler) is not ResumableBatchSampler:
        return
    main = state["_snapshot"]["_main_snapshot"] if "_snapshot" in state else state
    batches = main["_sampler_iter_state"]
    where = "state['loader']['_sampler_iter_state']"
    if not isinstance(batches, Mapping) or not is_int(batches.get("samples_yielded")):
        raise ValueError(
            f"MicrobatchingDataLoader.load_state_dict: {where} must be a dict with an int 'samples_yielded' (the "
            f"batch sampler's position), got {batches!r}; nothing was loaded"
        )
    order = batches.get("sampler_iter_state")
    if isinstance(batch_sampler.sampler, ShuffleSampler) and order is not None:
        size = len(batch_sampler.sampler.data_source)
        yielded, generator = (
            (order.get("yielded"), order.get("generator")) if isinstance(order, Mapping) else (None, None)
        )
        if not (is_int(yielded) and 0 <= yielded <= size and isinstance(generator, torch.Tensor)):
            raise ValueError(
                f"MicrobatchingDataLoader.load_state_dict: {where}['sampler_iter_state'] must hold the shuffled "
                f"epoch's position ('yielded', 0 to {size}) and its generator state, got {order!r}; nothing "
                "was loaded"
            )
