"""Lightning integration: ``Trainer(accumulate_grad_batches="auto")``, a callback, and module/datamodule mixins."""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a process without Lightning
    raise ImportError(
        'elastic_batches.lightning needs Lightning, which is not installed: pip install "elastic-batches[lightning]"'
    ) from err

from elastic_batches.lightning.callback import ElasticAccumulation
from elastic_batches.lightning.datamodule import ElasticDataModule
from elastic_batches.lightning.module import ElasticModule
from elastic_batches.lightning.trainer import Trainer

__all__ = ["ElasticAccumulation", "ElasticDataModule", "ElasticModule", "Trainer"]
