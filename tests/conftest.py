"""Shared fixtures: process-wide registries are restored after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_batches import collate, structures


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    """``register_batch_type`` / ``register_collate`` write process-wide registries: undo them per test."""
    batch_types = dict(structures._BATCH_TYPES)
    collate_fns = dict(collate._COLLATE_FNS)
    yield
    structures._BATCH_TYPES.clear()
    structures._BATCH_TYPES.update(batch_types)
    collate._COLLATE_FNS.clear()
    collate._COLLATE_FNS.update(collate_fns)
