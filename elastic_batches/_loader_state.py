"""Checking a saved position in an epoch (torchdata's ``StatefulDataLoader`` state) before it is loaded.

torchdata takes a state on ``load_state_dict`` and reads it only at the next ``iter()``: a
garbled state, or one saved with another ``num_workers``, fails there with an ``AssertionError``
or a ``KeyError`` far from its cause. :func:`check_loader_state` reads the same keys when the
state is loaded, so a bad one is refused with a message naming what is wrong, before anything
is applied. The layout is torchdata's: one process's position (``num_workers=0``), or the
workers' snapshot and the steps since it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_batches._state import StateFields, is_int

__all__ = ["check_loader_state", "saved_num_workers"]

_ONE_PROCESS = frozenset(
    {
        "_index_sampler_state",
        "_sampler_iter_state",
        "_sampler_iter_yielded",
        "_num_yielded",
        "_IterableDataset_len_called",
        "_shared_seed",
        "fetcher_state",
        "dataset_state",
        "_iterator_finished",
    }
)
_WORKERS = frozenset({"_snapshot", "_steps_since_snapshot", "_iterator_finished"})
_SNAPSHOT = frozenset({"_snapshot_step", "_last_yielded_worker_id", "_main_snapshot", "_worker_snapshots"})
_MAIN_SNAPSHOT = frozenset(
    {
        "_num_workers",
        "_sampler_iter_state",
        "_index_sampler_state",
        "_sampler_iter_yielded",
        "_IterableDataset_len_called",
        "_shared_seed",
        "_base_seed",
    }
)


def saved_num_workers(state: Mapping[str, Any]) -> int:
    """The ``num_workers`` of the loader that saved ``state`` (0 for one process)."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping) and isinstance(snapshot.get("_main_snapshot"), Mapping):
        workers = snapshot["_main_snapshot"].get("_num_workers")
        if is_int(workers):
            return workers
    return 0


def check_loader_state(state: Any, num_workers: int) -> None:
    """Refuse a saved position that a loader with ``num_workers`` workers cannot resume from.

    Args:
        state: ``state_dict()["loader"]`` of a ``MicrobatchingDataLoader``; ``{}`` (start afresh)
            is accepted, as torchdata does.
        num_workers: The workers of the loader it is loaded into.

    Raises:
        ValueError: ``state`` is not torchdata's layout (names the key and what is wrong), or it
            was saved with another ``num_workers`` (names both).

    Example:
        >>> from elastic_batches._loader_state import check_loader_state
        >>> try:
        ...     check_loader_state({"_snapshot": {"_main_snapshot": {"_num_workers": 2}}}, num_workers=0)
        ... except ValueError as err:
        ...     print(str(err).split(": ")[1].split(";")[0])
        the position in the epoch was saved by a loader with num_workers=2, this loader has num_workers=0
    """
    if isinstance(state, Mapping) and not state:
        return
    fields = StateFields("MicrobatchingDataLoader", {"loader": state}).nested("loader")
    saved = saved_num_workers(state)
    if saved != num_workers:
        raise ValueError(
            f"MicrobatchingDataLoader.load_state_dict: the position in the epoch was saved by a loader with "
            f"num_workers={saved}, this loader has num_workers={num_workers}; nothing was loaded. Resume with "
            f"num_workers={saved}, or load only what the controller learned: "
            "loader.controller.load_state_dict(state['controller'])"
        )
    if num_workers == 0:
        fields.keys(_ONE_PROCESS)
        fields.int("_num_yielded")
        fields.int("_sampler_iter_yielded")
    else:
        fields.keys(_WORKERS)
        fields.int("_steps_since_snapshot")
        snapshot = fields.nested("_snapshot")
        snapshot.keys(_SNAPSHOT)
        snapshot.int("_snapshot_step")
        snapshot.nested("_main_snapshot").keys(_MAIN_SNAPSHOT)
        snapshot.nested("_worker_snapshots").keys(frozenset(f"worker_{i}" for i in range(num_workers)))
    fields.bool("_iterator_finished")
