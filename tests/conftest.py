"""Shared fixtures: process-wide registries are restored after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_batches import registry


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
