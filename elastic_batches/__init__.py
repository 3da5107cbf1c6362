"""elastic_batches: automatic gradient accumulation that survives out-of-memory errors."""

from elastic_batches._version import __version__ as __version__
from elastic_batches.balance import BatchLoad
from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.collate import ElasticCollate, register_collate
from elastic_batches.controller import SplitController
from elastic_batches.loader import MicrobatchingDataLoader
from elastic_batches.oom import ElasticOOMError, is_oom_error
from elastic_batches.pyg import register_pyg_batch
from elastic_batches.step import ElasticStep
from elastic_batches.structures import register_batch_type
from elastic_batches.variable_length.counts import label_count
from elastic_batches.variable_length.shape_buckets import ShapeBuckets
from elastic_batches.variable_length.trim import TrimPadding

__all__ = [
    "BatchLoad",
    "ElasticBatch",
    "ElasticCollate",
    "ElasticOOMError",
    "ElasticStep",
    "Microbatch",
    "MicrobatchingDataLoader",
    "ShapeBuckets",
    "SplitController",
    "TrimPadding",
    "is_oom_error",
    "label_count",
    "register_batch_type",
    "register_collate",
    "register_pyg_batch",
]
