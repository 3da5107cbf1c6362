"""The :class:`~elastic_batches.SplitController`'s saved state: its keys, its versions, and the checks it passes.

:func:`read_state` checks every field of a state before the controller applies any, and turns
it into a :class:`ControllerState`: a state of version 1 (written before the memory model
existed) reads too, and a controller without a margin takes the size a predicting run agreed fits
as its search's bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from elastic_batches._state import StateFields, check_state_dict, is_int
from elastic_batches.balance import BatchLoad
from elastic_batches.memory.model import MemoryModel
from elastic_batches.memory.predictor import Predictor
from elastic_batches.search import SizeSearch

__all__ = ["STATE_KEYS", "STATE_VERSION", "ControllerState", "read_state", "write_state"]

STATE_VERSION = 2
STATE_KEYS_V1 = frozenset(
    {
        "version",
        "start_split_count",
        "fits",
        "fails",
        "last_rows",
        "last_lengths",
        "unit",
        "steps_since_oom",
        "grow_pending",
        "grow_wait",
        "oom_count",
        "retry_count",
        "discarded_microbatches",
    }
)
STATE_KEYS = STATE_KEYS_V1 | {"memory", "predicted", "fallback"}  # version 2: the memory model


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerState:
    """A controller's state, checked: what :meth:`SplitController.load_state_dict` applies."""

    start_split_count: int
    fits: int
    fails: int | None
    last: BatchLoad | None
    growth: tuple[int, bool, int | None]  # steps since the last OOM, a growth probe pending, the wait before one
    counters: tuple[int, int, int]  # OOMs, retries, discarded microbatches
    memory: MemoryModel | None  # a fresh model of the controller's margin, with the state's measurements
    predicted: int | None
    fallback: bool


def read_state(state: Mapping[str, Any], *, unit: str, margin: float | None) -> ControllerState:
    """Check ``state`` (from :meth:`SplitController.state_dict`) for a controller of ``unit`` and ``margin``.

    A state of version 1 (written before the memory model existed) reads too: the search's bounds
    and counters are restored, and the memory model starts with nothing measured (the first batch
    is measured again). A controller with ``margin=None`` ignores the memory model of a state, and
    takes the size it predicted fits as the search's bound (a larger size counts as failed), so it
    starts at the count the predicting run had learned; one with a margin keeps the larger of its
    own margin and the state's.

    Raises:
        ValueError: keys are missing or unexpected (both are named), the version is not one this
            code reads, the unit differs, or a field has the wrong type or range (named).
    """
    version = state.get("version")
    check_state_dict(
        "SplitController",
        state,
        STATE_KEYS_V1 if version == 1 else STATE_KEYS,
        STATE_VERSION if version != 1 else 1,
    )
    if state["unit"] != unit:
        raise ValueError(
            f"SplitController.load_state_dict: the state was learned with unit={state['unit']!r}, this "
            f"controller has unit={unit!r}: create it with SplitController(unit={state['unit']!r})"
        )
    fields = StateFields("SplitController", state)
    for key, low in (("start_split_count", 1), ("fits", 0), ("steps_since_oom", 0), ("oom_count", 0)):
        fields.int(key, low=low)
    for key in ("retry_count", "discarded_microbatches"):
        fields.int(key, low=0)
    for key in ("fails", "last_rows", "grow_wait"):
        fields.int(key, low=1, allow_none=True)
    fields.bool("grow_pending")
    if state["fails"] is not None and state["fits"] >= state["fails"]:
        raise fields.error("fits", f"below fails={state['fails']} (the smallest size that failed)")
    last: BatchLoad | None = None
    if state["last_rows"] is not None:
        lengths = state["last_lengths"]
        if lengths is not None and (not isinstance(lengths, (list, tuple)) or not all(map(is_int, lengths))):
            raise fields.error("last_lengths", "None or a list of ints")
        try:
            last = BatchLoad(state["last_rows"], lengths)
        except ValueError as err:
            raise fields.error("last_lengths", f"one length per row of last_rows ({err})") from err
    elif state["last_lengths"] is not None:
        raise fields.error("last_lengths", "None when last_rows is None")
    memory: MemoryModel | None = None
    if margin is not None:
        memory = MemoryModel(margin, unit=unit)
        if version != 1 and state["memory"] is not None:
            if not isinstance(state["memory"], Mapping):
                raise fields.error("memory", "None or a dict from MemoryModel.state_dict()")
            try:
                memory.load_state_dict(state["memory"])
            except ValueError as err:
                raise ValueError(f"SplitController.load_state_dict: state['memory']: {err}") from err
    if version != 1:
        fields.int("predicted", low=1, allow_none=True)
        fields.bool("fallback")
    fits, fails = state["fits"], state["fails"]
    if memory is None and version != 1 and state["predicted"] is not None:
        # Learned by prediction, planned by the search: what the model predicted fits bounds the search.
        predicted = state["predicted"]
        fails = predicted + 1 if fails is None else min(fails, predicted + 1)
        fits = min(fits, predicted)
    return ControllerState(
        start_split_count=state["start_split_count"],
        fits=fits,
        fails=fails,
        last=last,
        growth=(state["steps_since_oom"], state["grow_pending"], state["grow_wait"]),
        counters=(state["oom_count"], state["retry_count"], state["discarded_microbatches"]),
        memory=memory,
        predicted=None if version == 1 or memory is None else state["predicted"],
        fallback=False if version == 1 or memory is None else state["fallback"],
    )


def write_state(
    start_split_count: int,
    search: SizeSearch,
    last: BatchLoad | None,
    unit: str,
    counters: tuple[int, int, int],
    predictor: Predictor | None,
) -> dict[str, Any]:
    """A controller's state as plain values (what :func:`read_state` reads back)."""
    return {
        "version": STATE_VERSION,
        "start_split_count": start_split_count,
        "fits": search.fits,
        "fails": search.fails,
        "last_rows": None if last is None else last.rows,
        "last_lengths": None if last is None or last.lengths is None else list(last.lengths),
        "unit": unit,
        "steps_since_oom": search.steps_since_oom,
        "grow_pending": search.grow_pending,
        "grow_wait": search.grow_wait,
        "oom_count": counters[0],
        "retry_count": counters[1],
        "discarded_microbatches": counters[2],
        "memory": None if predictor is None else predictor.model.state_dict(),
        "predicted": None if predictor is None else predictor.agreed,
        "fallback": False if predictor is None else predictor.fallback,
    }
