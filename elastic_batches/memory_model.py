"""The memory model's earlier import path: :mod:`elastic_batches.memory.model` holds it now."""

from elastic_batches.memory.model import RECOVER_AFTER, SPREAD, MemoryModel

__all__ = ["RECOVER_AFTER", "SPREAD", "MemoryModel"]
