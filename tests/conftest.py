"""Shared fixtures (process-wide registries and warnings restored after every test) and the suite's markers.

``distributed``: spawns gloo ranks (a ``RankPool``, ``torchrun``); ``slow``: runs whole programs in
subprocesses (the examples, the demo, the docs' blocks, the command line) or spawns DataLoader
workers. ``make test-fast`` runs everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from elastic_batches import _warnings, registry


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    """``register_batch_type`` / ``register_collate`` write process-wide registries: undo them per test."""
    batch_types = dict(registry._BATCH_TYPES)
    collate_fns = dict(registry._COLLATE_FNS)
    yield
    registry._BATCH_TYPES.clear()
    registry._BATCH_TYPES.update(batch_types)
    registry._COLLATE_FNS.clear()
    registry._COLLATE_FNS.update(collate_fns)


@pytest.fixture(autouse=True)
def forget_warnings() -> Iterator[Callable[[], None]]:
    """``warn_once`` keeps a process-wide set of what it said: each test starts with it empty.

    A test that checks a warning is not given again calls the fixture's value to empty it in between.
    """
    _warnings._WARNED.clear()
    yield _warnings._WARNED.clear
    _warnings._WARNED.clear()


_DISTRIBUTED = frozenset(
    {
        "test_ddp_overlap",
        "test_distributed",
        "test_fault_matrix",
        "test_fsdp2_identity",
        "test_fsdp2_modules",
        "test_fsdp2_stand_ins",
        "test_lightning_ddp",
        "test_transformers_accelerate",
    }
)
_SLOW = frozenset(
    {
        "test_address_space",
        "test_demo",
        "test_examples",
        "test_main",
        "test_memory_budget_resize",
        "test_transformers",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test ``distributed`` or ``slow`` by its module, its fixtures and its name (see the module's doc)."""
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module in _DISTRIBUTED or "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)
        elif module in _SLOW or "spawn" in item.name or "ddp" in item.name:
            item.add_marker(pytest.mark.slow)
