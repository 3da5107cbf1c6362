"""Validation shared by every ``load_state_dict`` of the library."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_state_dict(owner: str, state: Mapping[str, Any], keys: frozenset[str], version: int) -> None:
    """Refuse a state with missing or unexpected keys, or of another version, naming what is wrong.

    Args:
        owner: The class whose ``load_state_dict`` is called, for the message.
        state: The state given.
        keys: The keys ``owner.state_dict()`` writes.
        version: The version ``owner.state_dict()`` writes under the key ``"version"``.

    Raises:
        ValueError: keys are missing or unexpected (both are named), or the version differs.

    Example:
        >>> from elastic_batches._state import check_state_dict
        >>> check_state_dict("Thing", {"version": 1, "count": 3}, frozenset({"version", "count"}), 1)
        >>> try:
        ...     check_state_dict("Thing", {"version": 1}, frozenset({"version", "count"}), 1)
        ... except ValueError as err:
        ...     print(str(err).split(";")[0])
        Thing.load_state_dict: missing keys ['count'], unexpected keys []
    """
    missing = sorted(keys - state.keys())
    unexpected = sorted(state.keys() - keys)
    if missing or unexpected:
        raise ValueError(
            f"{owner}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
            f"pass a dict produced by {owner}.state_dict()"
        )
    if state["version"] != version:
        raise ValueError(
            f"{owner}.load_state_dict: state version {state['version']!r} is not supported "
            f"(this elastic_batches writes version {version})"
        )
