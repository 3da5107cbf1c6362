"""``elastic_batches.lightning`` under DDP: 2 CPU processes on gloo, ``strategy="ddp"`` and ``"ddp_spawn"``.

Each scenario runs this file as a script in a fresh process group with a hard deadline (a hang
fails the test and kills every rank); Lightning starts the second rank itself, as it does for a
user. Every rank saves what it saw and trained to a directory the test then reads.

* ``ddp``: a plain DDP fit, an ``accumulate_grad_batches="auto"`` fit where rank 1 alone runs out
  of memory (forward of the first microbatch, backward of the last one), a fit whose
  DataLoaders are ``MicrobatchingDataLoader``s from an ``ElasticDataModule`` (Lightning injects
  its ``DistributedSampler`` by re-creating them), and a manual-optimization fit through
  ``elastic_backward`` with a rank-1 OOM. Each training batch records its sample ids.
* ``ddp_spawn``: the auto fit with the rank-1 OOM, under ``ddp_spawn`` (the model is pickled into
  the workers and its weights come back to the main process).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

DEADLINE_S = 150
HERE = Path(__file__).resolve().parent


def _run_scenario(scenario: str, out: Path) -> None:
    """Run this file as ``python test_lightning_ddp.py scenario out`` with a deadline; fail with its output."""
    _run_script([str(Path(__file__).resolve()), scenario, str(out)], scenario)


def _run_script(arguments: list[str], name: str) -> str:
    """Run ``python *arguments`` in a new process group with a deadline; its output, or the test fails with it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    process = subprocess.Popen(
        [sys.executable, *arguments],
        cwd=HERE.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # every rank: Lightning's second rank is in the same group
        output, _ = process.communicate()
        pytest.fail(f"{name}: no result after {DEADLINE_S} s (a hang?); output:\n{output[-6000:]}")
    if process.returncode != 0:
        pytest.fail(f"{name}: exit code {process.returncode}; output:\n{output[-6000:]}")
    return output


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The "ddp" scenario (DDP fits, then FSDP2 fits in the same two processes), run once: one dict per rank."""
    out = tmp_path_factory.mktemp("ddp")
    _run_scenario("ddp", out)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_ddp_rank_one_oom_recovers_shards_stay_per_rank_and_weights_equal_plain_ddp(
    ddp_results: list[dict[str, Any]],
) -> None:
    ranks = ddp_results
    for rank, result in enumerate(ranks):
        _same(result["auto"]["params"], result["plain"]["params"])
        _same(result["datamodule"]["params"], result["plain"]["params"])
        assert result["auto"]["global_step"] == result["plain"]["global_step"] == 8
        assert result["auto"]["controller"]["retry_count"] == 2, rank  # both ranks retried rank 1's OOMs
        assert result["auto"]["controller"]["fits"] == ranks[0]["auto"]["controller"]["fits"]
    for run in ("plain", "auto", "datamodule"):
        for epoch in range(2):
            shards = [set(result[run]["seen"][epoch * 20 : (epoch + 1) * 20]) for result in ranks]
            assert len(shards[0]) == len(shards[1]) == 20, (run, epoch)  # each rank its own 20 samples
            assert shards[0] | shards[1] == set(range(40)), (run, epoch)  # together the whole dataset
    assert ranks[0]["datamodule"]["loader"] == ranks[1]["datamodule"]["loader"] == ("MicrobatchingDataLoader", True)


def test_ddp_manual_optimization_recovers_a_rank_one_oom_and_equals_plain_ddp(
    ddp_results: list[dict[str, Any]],
) -> None:
    """``elastic_backward``, then ``clip_gradients`` (its norm agreed on by both ranks) and ``optimizer.step``."""
    for result in ddp_results:
        _same(result["manual"]["params"], result["manual_plain"]["params"])
        assert result["manual"]["controller"]["retry_count"] == 1


def test_ddp_manual_optimization_without_the_mixin_runs_as_plain_ddp_on_every_rank_warning_on_rank_zero(
    ddp_results: list[dict[str, Any]],
) -> None:
    for result in ddp_results:
        _same(result["manual_unmixed"]["params"], result["manual_plain"]["params"])
    assert [result["manual_unmixed"]["warnings"] for result in ddp_results] == [1, 0]


def test_fsdp2_through_model_parallel_strategy_recovers_a_rank_one_oom_and_equals_plain_fsdp2(
    ddp_results: list[dict[str, Any]],
) -> None:
    for result in ddp_results:
        _same(result["fsdp2_auto"]["params"], result["fsdp2_plain"]["params"])
        assert result["fsdp2_auto"]["controller"]["retry_count"] == 1


def _union_batches(epochs: int, batch_size: int) -> list[list[int]]:
    """The sample ids of each DDP step: rank 0's batch then rank 1's, from Lightning's DistributedSampler."""
    from _lightning_models import IdDataset

    steps: list[list[int]] = []
    for epoch in range(epochs):
        shards = []
        for rank in range(2):
            sampler = DistributedSampler(IdDataset(), num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), batch_size):
            steps.append(shards[0][start : start + batch_size] + shards[1][start : start + batch_size])
    return steps


def test_ddp_spawn_rank_one_oom_recovers_and_equals_one_process_on_the_union_batches(tmp_path: Path) -> None:
    # DDP averages the ranks' mean losses over batches of equal size: the update is that of the
    # mean loss over the union of the ranks' batches. One process fed those unions (Lightning's
    # DistributedSampler order, seed 0, reshuffled each epoch) is the plain reference.
    import lightning.pytorch as pl
    from _lightning_models import IdDataset, Regression, fit, parameters_of

    _run_scenario("ddp_spawn", tmp_path)
    result = torch.load(tmp_path / "spawn.pt")
    reference = Regression()
    fit(pl.Trainer, reference, DataLoader(IdDataset(), batch_sampler=_union_batches(2, 5)), max_epochs=1)
    _same(result["params"], parameters_of(reference))
    assert result["metrics"]["elastic/oom_retries"] == 1.0 and result["metrics"]["elastic/split_count"] == 2.0


def test_ddp_spawn_padded_batches_retry_an_oom_in_rank_ones_cut_in_training_and_validation(tmp_path: Path) -> None:
    """Rank 1 runs out of memory cutting a padded microbatch, once in training, once in validation: no hang,
    and the weights and the synced validation loss are those of the same fit without the OOMs."""
    _run_scenario("ddp_spawn_padded", tmp_path)
    runs = torch.load(tmp_path / "padded.pt")
    _same(runs[True]["params"], runs[False]["params"])
    assert abs(runs[True]["val_loss"] - runs[False]["val_loss"]) <= 1e-6 * abs(runs[False]["val_loss"])
    assert runs[True]["train_oom_retries"] == 1.0 and runs[False]["train_oom_retries"] == 0.0


def test_example_lightning_ddp_rank_one_short_of_memory_both_ranks_agree() -> None:
    output = _run_script([str(HERE.parent / "examples" / "lightning_ddp.py"), "--quick"], "examples/lightning_ddp.py")
    # the two ranks print to one pipe: their lines may run together, so each record is found where it is
    results = sorted(
        (json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", output)), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["own_ooms"] == 0 and results[1]["own_ooms"] >= 1  # only rank 1 ran out of memory
    assert results[0]["split_count"] == results[1]["split_count"] > 1  # and both ranks split alike
    assert results[0]["oom_retries"] == results[1]["oom_retries"] == results[1]["own_ooms"]
    # fp32 after AdamW steps: the first attempt measures (memory="auto" finds the budgets), cutting the batch into
    # other pieces than a balanced split, whose sums round otherwise; the same run in float64 agrees to 2e-15
    assert all(r["max_relative_difference"] < 1e-4 for r in results)


# -- the scenarios, run as a script ----------------------------------------------------------------


def _ddp(out: Path) -> None:
    import lightning.pytorch as pl
    from _lightning_models import (
        ElasticManual,
        IdDataset,
        Manual,
        Regression,
        loader,
        parameters_of,
        quiet_trainer_kwargs,
    )
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from elastic_batches.lightning import ElasticDataModule, Trainer

    class Sharded(Regression):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    class Data(ElasticDataModule, pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            generator = torch.Generator().manual_seed(1)
            return self.elastic_dataloader(IdDataset(), batch_size=5, shuffle=True, generator=generator)

    ddp = {"strategy": "ddp", "devices": 2}
    result: dict[str, Any] = {}

    plain_model = Regression(record_ids=True)
    plain = pl.Trainer(**quiet_trainer_kwargs(**ddp))
    plain.fit(plain_model, loader(5, shuffle=True))
    result["plain"] = {"params": parameters_of(plain_model), "seen": plain_model.seen, "global_step": plain.global_step}

    # rank 1 alone: OOM in the forward of its first microbatch, then in the backward of the last
    # microbatch of the next batch (the first batch retries as 2: calls 1, 2; the next is 3, 4)
    oom = [{"phase": "forward", "calls": [0], "rank": 1}, {"phase": "backward", "calls": [4], "rank": 1}]
    auto_model = Regression(record_ids=True, oom=oom)
    auto = Trainer(**quiet_trainer_kwargs(accumulate_grad_batches="auto", **ddp))
    auto.fit(auto_model, loader(5, shuffle=True))
    result["auto"] = {
        "params": parameters_of(auto_model),
        "seen": auto_model.seen,
        "global_step": auto.global_step,
        "controller": auto.elastic.controllers["train"].state_dict(),
    }

    data_model = Regression(record_ids=True, oom={"phase": "backward", "calls": [0], "rank": 0})
    with_data = Trainer(**quiet_trainer_kwargs(accumulate_grad_batches="auto", **ddp))
    data = Data()
    with_data.fit(data_model, datamodule=data)
    loader_ = with_data.train_dataloader
    result["datamodule"] = {
        "params": parameters_of(data_model),
        "seen": data_model.seen,
        "loader": (type(loader_).__name__, loader_.controller is with_data.elastic.controllers["train"]),
    }

    # manual optimization: elastic_backward, clip_gradients and optimizer.step in training_step
    manual_plain = Manual()
    pl.Trainer(**quiet_trainer_kwargs(**ddp)).fit(manual_plain, loader(5))
    manual_model = ElasticManual(oom={"phase": "backward", "calls": [0], "rank": 1})
    manual = Trainer(**quiet_trainer_kwargs(accumulate_grad_batches="auto", **ddp))
    manual.fit(manual_model, loader(5))
    # manual optimization without ElasticModule: runs on every rank as under the plain DDP Trainer
    unmixed = Manual()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**quiet_trainer_kwargs(accumulate_grad_batches="auto", **ddp)).fit(unmixed, loader(5))
    result["manual_unmixed"] = {
        "params": parameters_of(unmixed),
        "warnings": sum("uses manual optimization" in str(w.message) for w in caught),
    }
    result["manual_plain"] = {"params": parameters_of(manual_plain)}
    result["manual"] = {
        "params": parameters_of(manual_model),
        "controller": manual.elastic.controllers["train"].state_dict(),
    }

    # FSDP2 (fully_shard) through Lightning's ModelParallelStrategy, which runs on CPU
    for name, oom in (("fsdp2_plain", None), ("fsdp2_auto", {"phase": "backward", "calls": [0], "rank": 1})):
        model = Sharded(oom=oom)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        trainer_class = pl.Trainer if oom is None else Trainer
        extra = {} if oom is None else {"accumulate_grad_batches": "auto"}
        trainer = trainer_class(**quiet_trainer_kwargs(strategy=strategy, devices=2, max_epochs=1, **extra))
        trainer.fit(model, loader(5))
        result[name] = {
            "params": [p.full_tensor().detach().clone() for p in model.parameters()],
            "controller": None if oom is None else trainer.elastic.controllers["train"].state_dict(),
        }
    torch.save(result, out / f"rank{auto.global_rank}.pt")


def _ddp_spawn(out: Path) -> None:
    from _lightning_models import Regression, loader, parameters_of, quiet_trainer_kwargs

    from elastic_batches.lightning import ElasticAccumulation, Trainer

    model = Regression(oom={"phase": "backward", "calls": [0], "rank": 1})
    elastic = ElasticAccumulation(log_metrics=True)  # the elastic/* metrics come back with callback_metrics
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accumulate_grad_batches="auto", strategy="ddp_spawn", devices=2, log_every_n_steps=1, callbacks=[elastic]
        )
    )
    trainer.fit(model, loader(5))
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    torch.save({"params": parameters_of(model), "metrics": metrics}, out / "spawn.pt")


def _ddp_spawn_padded(out: Path) -> None:
    """Padded train and validation batches under ``ddp_spawn``, with and without rank 1's OOMs in the cut."""
    from _lightning_models import PaddedIdDataset, PaddedRegression, parameters_of, quiet_trainer_kwargs

    import elastic_batches as eb
    from elastic_batches.lightning import ElasticAccumulation, Trainer

    runs = {}
    for cut_oom in (False, True):
        elastic = ElasticAccumulation(
            controllers={"train": eb.SplitController(split_count=2), "validate": eb.SplitController(split_count=2)},
            log_metrics=True,
        )

        def padded(stage: str, elastic: ElasticAccumulation = elastic) -> eb.MicrobatchingDataLoader:
            return eb.MicrobatchingDataLoader(
                DataLoader(PaddedIdDataset(), batch_size=6),
                pad_values={"pad": 0.0},
                controller=elastic.controllers[stage],
            )

        model = PaddedRegression(cut_oom=cut_oom)
        trainer = Trainer(
            **quiet_trainer_kwargs(
                accumulate_grad_batches="auto",
                strategy="ddp_spawn",
                devices=2,
                max_epochs=1,
                callbacks=[elastic],
                log_every_n_steps=1,
            )
        )
        trainer.fit(model, padded("train"), padded("validate"))
        runs[cut_oom] = {
            "params": parameters_of(model),
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "train_oom_retries": float(trainer.callback_metrics["elastic/oom_retries"]),
        }
    torch.save(runs, out / "padded.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    scenario, directory = sys.argv[1], Path(sys.argv[2])
    {"ddp": _ddp, "ddp_spawn": _ddp_spawn, "ddp_spawn_padded": _ddp_spawn_padded}[scenario](directory)
