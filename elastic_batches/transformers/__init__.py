"""Hugging Face integration: a ``transformers.Trainer`` whose batches are split on OOM, with the same update."""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a process without transformers
    raise ImportError(
        "elastic_batches.transformers needs transformers and accelerate, which are not installed: "
        'pip install "elastic-batches[transformers]"'
    ) from err

from elastic_batches.transformers.trainer import Trainer

__all__ = ["Trainer"]
