"""Validation shared by every ``load_state_dict`` of the library: the keys and version, then each field."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, TypeGuard


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


def is_int(value: Any, *, integral: bool = False) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is an ``int`` to Python, never a count here).

    With ``integral``, any :class:`numbers.Integral` counts (a NumPy integer too).

    Example:
        >>> import numpy as np
        >>> from elastic_batches._state import is_int
        >>> is_int(3), is_int(True), is_int(3.0), is_int(np.int64(3)), is_int(np.int64(3), integral=True)
        (True, False, False, False, True)
    """
    return isinstance(value, numbers.Integral if integral else int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float and not a bool.

    Example:
        >>> from elastic_batches._state import is_number
        >>> is_number(0.5), is_number(2), is_number(False)
        (True, True, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StateFields:
    """Checks the fields of one state before any is applied; each error names the field, what it must be, the fix.

    Args:
        owner: The class whose ``load_state_dict`` is called.
        state: The state given.
        where: The path of ``state`` inside the state passed (``"['loader']"``), for the message.
        source: What produces a valid state, for the message (default: ``owner.state_dict()``).

    Example:
        >>> from elastic_batches._state import StateFields
        >>> fields = StateFields("Thing", {"count": -1})
        >>> try:
        ...     fields.int("count", low=0)
        ... except ValueError as err:
        ...     print(str(err).split(";")[0])
        Thing.load_state_dict: state['count'] must be an int >= 0, got -1
    """

    def __init__(self, owner: str, state: Mapping[str, Any], *, where: str = "", source: str | None = None) -> None:
        self.owner, self.state, self.where = owner, state, where
        self.source = source if source is not None else f"{owner}.state_dict()"

    def refuse(self, problem: str, key: str | None = None) -> ValueError:
        """The error saying that ``state`` (or ``state[key]``) has ``problem``; nothing was loaded."""
        where = self.where if key is None else f"{self.where}[{key!r}]"
        return ValueError(
            f"{self.owner}.load_state_dict: state{where} {problem}; nothing was loaded. Pass a dict produced by "
            f"{self.source}"
        )

    def error(self, key: str, expected: str, value: Any = None) -> ValueError:
        """The error for ``state[key]``, which must be ``expected`` (its value read from the state unless given)."""
        value = self.state.get(key) if value is None else value
        return self.refuse(f"must be {expected}, got {value!r}", key)

    def keys(self, expected: frozenset[str]) -> None:
        """``state`` holds exactly the keys ``expected`` (both kinds of difference are named)."""
        missing, unexpected = sorted(expected - self.state.keys()), sorted(self.state.keys() - expected)
        if missing or unexpected:
            raise self.refuse(f"has missing keys {missing} and unexpected keys {unexpected}")

    def nested(self, key: str) -> StateFields:
        """The fields of ``state[key]``, which must be a dict; its errors name the path to it."""
        value = self.state[key]
        if not isinstance(value, Mapping):
            raise self.refuse(f"must be a dict, got {type(value).__qualname__}", key)
        return StateFields(self.owner, value, where=f"{self.where}[{key!r}]", source=self.source)

    def int(self, key: str, *, low: int = 0, allow_none: bool = False) -> None:
        """``state[key]`` is an int ``>= low`` (or ``None`` where allowed)."""
        value = self.state[key]
        if value is None and allow_none:
            return
        if not is_int(value) or value < low:
            raise self.error(key, f"an int >= {low}" + (" or None" if allow_none else ""))

    def bool(self, key: str) -> None:
        """``state[key]`` is a bool."""
        if not isinstance(self.state[key], bool):
            raise self.error(key, "a bool")

    def fraction(self, key: str, high: float) -> None:
        """``state[key]`` is a number in ``[0, high]``."""
        value = self.state[key]
        if not is_number(value) or not 0 <= value <= high:
            raise self.error(key, f"a number in [0, {high}]")


def positive_int(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``owner`` and ``name`` unless ``value`` is an int >= 1 (or ``None`` if allowed)."""
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        allowed = "an int >= 1 or None" if allow_none else "an int >= 1"
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
