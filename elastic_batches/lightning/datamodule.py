"""``ElasticDataModule``: a LightningDataModule mixin whose loaders share the Trainer's controllers."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from elastic_batches.controller import SplitController
from elastic_batches.lightning._stages import STAGES, stages_of
from elastic_batches.loader import MicrobatchingDataLoader

__all__ = ["ElasticDataModule"]


class ElasticDataModule:
    """Mixin for a ``LightningDataModule`` (``class Data(ElasticDataModule, pl.LightningDataModule)``).

    Its :meth:`elastic_dataloader` returns a :class:`elastic_batches.MicrobatchingDataLoader`
    whose controller is the stage's controller of the Trainer's ``ElasticAccumulation``: the
    loader tags each batch with the count learned so far, and the batch is collated (and, with
    ``pad_values``, padded per microbatch) in the loader's workers. Lightning still injects its
    ``DistributedSampler`` into these loaders (it re-creates them from their arguments), and the
    re-created loader keeps the same controller.

    The Trainer's hooks then receive :class:`elastic_batches.ElasticBatch` objects; the steps
    (``training_step``, ``validation_step``...) still receive each microbatch in your structure.

    Example:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from elastic_batches.lightning import ElasticDataModule
        >>> class Data(ElasticDataModule, pl.LightningDataModule):
        ...     def train_dataloader(self):
        ...         return self.elastic_dataloader(TensorDataset(torch.randn(10, 3)), batch_size=4)
        >>> data = Data()
        >>> loader = data.train_dataloader()
        >>> len(loader), loader.controller is data.elastic_controller("train")
        (3, True)
    """

    def elastic_controller(self, stage: str = "train") -> SplitController:
        """The controller of ``stage``: the Trainer's (its ``ElasticAccumulation``), else the datamodule's own.

        Args:
            stage: ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``.

        Raises:
            ValueError: unknown stage.
        """
        if stage not in STAGES:
            raise ValueError(f"{type(self).__name__}.elastic_controller: unknown stage {stage!r}; use one of {STAGES}")
        stages = stages_of(getattr(self, "trainer", None))
        if stages is not None:
            return stages.controllers[stage]
        own: dict[str, SplitController] = self.__dict__.setdefault("_elastic_own_controllers", {})
        return own.setdefault(stage, SplitController())

    def elastic_dataloader(
        self, dataset: Any, batch_size: int | None = None, *, stage: str = "train", **dataloader_kwargs: Any
    ) -> MicrobatchingDataLoader:
        """A :class:`MicrobatchingDataLoader` over ``dataset`` (or wrapping a DataLoader) with ``stage``'s controller.

        Args:
            dataset: A dataset, or a ``DataLoader`` to wrap.
            batch_size: Rows per batch; ``None`` keeps the wrapped loader's (or 1 for a dataset).
            stage: Whose controller the loader shares: ``"train"``, ``"validate"``, ``"test"``, ``"predict"``.
            **dataloader_kwargs: Any other ``MicrobatchingDataLoader`` / ``DataLoader`` argument.
                ``shuffle=True`` over a dataset becomes ``sampler=torch.utils.data.RandomSampler``, as
                in a plain ``DataLoader``, so that Lightning shards it as it shards a plain loader.
        """
        if batch_size is not None:
            dataloader_kwargs["batch_size"] = batch_size
        if (
            dataloader_kwargs.get("shuffle")
            and dataloader_kwargs.get("sampler") is None
            and dataloader_kwargs.get("batch_sampler") is None
            and not isinstance(dataset, (DataLoader, IterableDataset))
        ):
            # torch's RandomSampler, as DataLoader(shuffle=True) builds: Lightning replaces it by a
            # DistributedSampler under DDP, exactly as for the plain loader (torchdata's stateful
            # RandomSampler would be wrapped instead, which shards the same samples in another order)
            del dataloader_kwargs["shuffle"]
            dataloader_kwargs["sampler"] = RandomSampler(dataset, generator=dataloader_kwargs.get("generator"))
        return MicrobatchingDataLoader(dataset, controller=self.elastic_controller(stage), **dataloader_kwargs)
