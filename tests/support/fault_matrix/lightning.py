"""A cell under ``Trainer(accumulate_grad_batches="auto")``, and Lightning's validation of padded batches."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import inject_oom, inject_oom_in_cut

from support.fault_matrix.cells import (
    GATHER,
    GLOBAL_ROWS,
    LR,
    MAX_GRAD_NORM,
    OOM_STEP,
    SAMPLES,
    SPLIT,
    STEPS,
    Cell,
    IdModel,
    Snapshots,
    dataset,
    flat,
    loss_of,
    oom_call,
    pad_length,
    reference,
    step_ids,
)
from support.fault_matrix.checks import id_check
from support.fault_matrix.plain import GradNormOOM, error_of, result_of

__all__ = ["lightning_environment", "run_lightning_cell", "run_lightning_validation", "validation_reference"]


def _elastic(trainer: Any) -> Any:
    """The trainer's ``ElasticAccumulation`` (there is one: every cell runs under ``"auto"``)."""
    from elastic_batches.lightning import ElasticAccumulation

    elastic = ElasticAccumulation.find(trainer)
    assert elastic is not None
    return elastic


def _lightning_module(cell: Cell, rank: int, rows: int) -> Any:
    """A LightningModule training :class:`IdModel`, with the cell's injection installed at ``on_fit_start``."""
    import lightning.pytorch as pl

    class FaultySGD(torch.optim.SGD):
        """SGD that runs out of memory in chosen steps, after the closure (where an optimizer allocates its state)."""

        def __init__(self, params: Any, fail_at: int | None) -> None:
            super().__init__(params, lr=LR)
            self.fail_at, self.calls, self.fired = fail_at, 0, 0

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            index, self.calls = self.calls, self.calls + 1
            if index == self.fail_at:
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in SGD.step)")
            super().step()
            return loss

    class IdModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            model = IdModel()
            self.net, self.ids = model.net, model.ids
            self.ids_checks: list[dict[str, Any]] = []
            self.counts: list[int] = []  # the controller's split count after each step
            self.fired = 0
            self._handles: list[Any] = []
            self.optimizer: FaultySGD | None = None

        def configure_model(self) -> None:
            if cell.setting.startswith("fsdp2"):
                _shard(self, (self.net[0], self.net[2], self.ids))

        def on_fit_start(self) -> None:
            call = oom_call(cell, rank, rows)
            if call is None:
                return
            if cell.phase == "cut":
                self._handles = [inject_oom_in_cut(calls=OOM_STEP * SPLIT + call)]
                return
            target = self.net if cell.phase == "forward" else self.net[0]
            self._handles = [inject_oom(target, phase=cell.phase, calls=OOM_STEP * SPLIT + call)]  # type: ignore

        def on_fit_end(self) -> None:
            self._release()

        def _release(self) -> None:
            self.fired += sum(h.fired for h in self._handles)
            for h in self._handles:
                h.remove()
            self._handles = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = loss_of((self.net(batch["x"]), self.ids(batch["id"])), batch["y"])
            return loss + 0.0 * batch["pad"].sum() if "pad" in batch else loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.counts.append(_elastic(self.trainer).controllers["train"].split_count)

        def _strikes(self, phase: str) -> bool:
            return cell.phase == phase and cell.fires_on(rank) and self.trainer.global_step == OOM_STEP

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.ids_checks.append(id_check(flat([self.ids.weight.grad]), self.trainer.global_step))
            if self._strikes("hook"):
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in a user hook)")

        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            if not self._strikes("clip"):
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
                return
            injection = GradNormOOM(_elastic(self.trainer).step_for("train"))
            try:
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            finally:
                self.fired += injection.fired
                injection.remove()

        def configure_optimizers(self) -> Any:
            fail_at = OOM_STEP if cell.phase == "step" and cell.fires_on(rank) else None
            self.optimizer = FaultySGD(self.parameters(), fail_at)
            return self.optimizer

    return IdModule()


class _Rows(torch.utils.data.Dataset):
    """The samples as dicts; with ``padded``, each with its ragged ``pad`` field too."""

    def __init__(self, padded: bool = False) -> None:
        self.x, self.y = dataset()
        self.padded = padded

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"x": self.x[index], "y": self.y[index], "id": index}
        if self.padded:
            sample["pad"] = torch.ones(pad_length(index))
        return sample


def _trainer(setting: str, world: int, elastic: Any, **kwargs: Any) -> Any:
    """A quiet ``Trainer(accumulate_grad_batches="auto")`` on the CPU for one setting (``kwargs``: more options)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from elastic_batches.lightning import Trainer

    strategy: Any = {"single": "auto", "ddp": "ddp"}.get(setting)
    if setting.startswith("fsdp2"):
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return Trainer(
        accumulate_grad_batches="auto",
        callbacks=[elastic],
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _shard(module: Any, parts: tuple[nn.Module, ...]) -> None:
    """``fully_shard`` each of ``parts``, then ``module``, over the strategy's data-parallel mesh (Lightning FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for part in parts:
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)


def run_lightning_cell(cell: Cell, rank: int = 0, world: int = 1, snapshots: Snapshots | None = None) -> dict:
    """Fit the cell's ``STEPS`` steps with ``Trainer(accumulate_grad_batches="auto")``; what happened."""
    import warnings

    from elastic_batches.lightning import ElasticAccumulation

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
    snapshots = snapshots if snapshots is not None else reference()
    rows = GLOBAL_ROWS // world
    module = _lightning_module(cell, rank, rows)
    controllers = {"train": eb.SplitController(split_count=SPLIT)}
    elastic = ElasticAccumulation(controllers=controllers, gather=GATHER.get(cell.setting, "auto"))
    trainer = _trainer(
        cell.setting,
        world,
        elastic,
        max_steps=STEPS,
        max_epochs=1,
        gradient_clip_val=MAX_GRAD_NORM,
        num_sanity_val_steps=0,
    )
    padded = cell.phase == "cut"
    if world == 1:
        loader: Any = torch.utils.data.DataLoader(
            _Rows(padded), batch_sampler=[step_ids(i).tolist() for i in range(STEPS)]
        )
    else:  # Lightning puts in its DistributedSampler, which gives step_ids(step, rank, 2)
        loader = torch.utils.data.DataLoader(_Rows(padded), batch_size=rows)
    if padded:  # Lightning re-creates it with its DistributedSampler, as it does a DataLoader
        loader = eb.MicrobatchingDataLoader(loader, pad_values={"pad": 0.0}, controller=elastic.controllers["train"])
    error = None
    try:
        trainer.fit(module, loader)
    except Exception as err:
        error = error_of(err, trainer.global_step)
    module._release()
    fired = module.fired + (module.optimizer.fired if module.optimizer is not None else 0)
    return result_of(
        cell,
        trainer.global_step,
        error,
        module,
        snapshots,
        module.ids_checks,
        module.counts,
        fired,
        elastic.controllers["train"],
    )


def run_lightning_validation(rank: int, world: int, setting: str, fire_rank: int | None) -> dict[str, Any]:
    """``trainer.validate`` on padded batches, with an OOM in the cut of ``fire_rank``'s second microbatch.

    The validation loss is logged with ``sync_dist``: every rank must reach it with the mean over
    the union of the ranks' batches (no hang, nothing lost or counted twice).
    """
    import warnings

    import lightning.pytorch as pl

    from elastic_batches.lightning import ElasticAccumulation

    warnings.filterwarnings("ignore")
    if world > 1:
        lightning_environment(rank, world)
    model = IdModel()

    class Validated(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.ids = model.net, model.ids

        def configure_model(self) -> None:
            if setting.startswith("fsdp2"):
                _shard(self, (self.net[0], self.net[2], self.ids))

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = loss_of((self.net(batch["x"]), self.ids(batch["id"])), batch["y"]) + 0.0 * batch["pad"].sum()
            self.log("val_loss", loss, sync_dist=True)

    controllers = {"validate": eb.SplitController(split_count=SPLIT)}
    elastic = ElasticAccumulation(controllers=controllers, gather=GATHER.get(setting, "auto"))
    trainer = _trainer(setting, world, elastic)
    rows = GLOBAL_ROWS // world
    loader = eb.MicrobatchingDataLoader(
        torch.utils.data.DataLoader(_Rows(padded=True), batch_size=rows),
        pad_values={"pad": 0.0},
        controller=elastic.controllers["validate"],
    )
    with inject_oom_in_cut(calls=1, rank=fire_rank) as oom:
        metrics = trainer.validate(Validated(), loader, verbose=False)
    return {"val_loss": metrics[0]["val_loss"], "fired": oom.fired, "ooms": elastic.controllers["validate"].oom_count}


def validation_reference() -> float:
    """The mean over the validation epoch's batches of each global batch's mean loss (full batches, no split)."""
    model = IdModel()
    x, y = dataset()
    with torch.no_grad():
        losses = [
            float(loss_of(model(x[i : i + GLOBAL_ROWS], torch.arange(i, i + GLOBAL_ROWS)), y[i : i + GLOBAL_ROWS]))
            for i in range(0, SAMPLES, GLOBAL_ROWS)
        ]
    return sum(losses) / len(losses)


def lightning_environment(rank: int, world: int) -> None:
    """Tell Lightning the processes exist already (as torchrun does), so that it joins the process group.

    Its INFO lines are quieted: every cell builds a Trainer, which would print the accelerator banner again
    (after Lightning's import, which sets its logger's level).
    """
    import lightning.pytorch  # noqa: F401

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29555"),  # never used: the group is initialized
        }
    )
