"""The BatchNorm policy: what splitting means for a model's training-mode BatchNorm layers.

A training-mode BatchNorm normalises each microbatch by its own statistics: it needs 2 rows or
more (the floor every plan keeps), it computes other statistics than the whole batch would (said
once per step object when a batch is first split), and a batch that would need one-row
microbatches to fit stops where ``min_microbatch_size=2`` would.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from elastic_batches._warnings import warn_on_rank_zero
from elastic_batches.balance import BatchLoad
from elastic_batches.oom import ElasticOOMError

__all__ = ["BatchNormPolicy"]


class BatchNormPolicy:
    """The BatchNorm layers of ``model``, listed once, and what they ask of a split.

    Example:
        >>> import torch
        >>> from elastic_batches.batchnorm import BatchNormPolicy
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> policy = BatchNormPolicy(model)
        >>> policy.floor(), policy.training()
        (2, ["BatchNorm1d '1'"])
        >>> _ = model.eval()
        >>> policy.floor()
        1
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._layers: list[tuple[str, nn.Module]] | None = None  # listed when first asked
        self._warned = False

    def _listed(self) -> list[tuple[str, nn.Module]]:
        if self._layers is None:
            self._layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        return self._layers

    def training(self) -> list[str]:
        """``Type 'name'`` of each BatchNorm layer of the model in training mode."""
        return [f"{type(m).__name__} {name!r}" for name, m in self._listed() if m.training]

    def floor(self) -> int:
        """The fewest rows a microbatch may have for the model: 2 through a training-mode BatchNorm, else 1."""
        return 2 if any(m.training for _, m in self._listed()) else 1

    def warn(self, how: str) -> None:
        """Say once per step object that splitting changes the statistics of training-mode BatchNorm layers."""
        if self._warned:
            return
        norms = self.training()
        if norms:
            self._warned = True
            warn_on_rank_zero(
                f"elastic_batches: {type(self.model).__name__} has BatchNorm layers in training mode "
                f"({', '.join(norms)}) and its batches are split ({how}): their batch "
                "statistics, and the running statistics, are computed per microbatch, not over the whole batch. Use "
                "GroupNorm or LayerNorm where whole-batch statistics matter",
                stacklevel=5,
            )

    def limit(self, load: BatchLoad, sizes: list[int], size: int) -> ElasticOOMError | None:
        """The final error when the next cut (``sizes``) has a one-row microbatch through a training-mode BatchNorm."""
        if load.rows < 2 or min(sizes) >= 2:
            return None
        norms = self.training()
        if not norms:
            return None
        return ElasticOOMError(
            f"out of memory on a batch of {load.rows} rows at microbatch size {size}, and the next split would cut "
            f"microbatches of 1 row, which {', '.join(norms)} cannot normalise in training mode (batch statistics "
            "need 2 rows or more): for a model with training-mode BatchNorm, ElasticStep stops where "
            "min_microbatch_size=2 would. Lower the batch size, free memory, or use GroupNorm or LayerNorm"
        )
