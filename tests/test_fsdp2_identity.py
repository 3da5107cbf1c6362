"""FSDP2 per module, second pass (issue 25): collectives paired by unit, evaluation between steps, tied weights.

Two gloo ranks (four for HSDP), each case under a deadline (``support.ranks.RankPool``).

* A mixture of two experts where each rank routes every row to one expert (an expert with no row
  is skipped): under ``gather="module"`` the ranks would pair one expert's collectives with the
  other's (equal sizes: silently wrong gradients); every rank raises ``RuntimeError`` naming both
  units instead, guarded or scripted, before any collective of the experts starts. Gathered once
  (``"attempt"``, ``"auto"``) it trains exactly.
* Validation between training steps (``step.evaluate`` or a bare ``torch.no_grad()`` forward, every
  step or every 3 steps) leaves the training script in use: 2 side-channel rounds a step once
  scripted, as without validation.
* Tied weights in FSDP2's own layout (``fully_shard([embedding, head])``) train under every
  ``gather`` value, exactly.

The reference is plain full-batch training on the union of the ranks' batches (float32); weights
must match it within ``RTOL``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb

from support.fault_matrix.experts import Experts
from support.ranks import RankPool

RTOL = 1e-5
LR = 0.1
SPLIT = 3
_MESHES: dict[tuple[int, ...], Any] = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("identity-ranks"), world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("identity-hsdp"), world_size=4)
    yield pool
    pool.close()


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _world_mesh() -> Any:
    world = dist.get_world_size()
    return _mesh((world,) if world == 2 else (2, world // 2))


def _full(tensors: Any) -> torch.Tensor:
    parts = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# -- a mixture of two experts ----------------------------------------------------------------------


def _routed_batch(step: int, rank: int, expert: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """12 rows; every row to ``expert`` (``None``: the rows alternate between both)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(12, 6, generator=generator)
    route = torch.arange(12) % 2 if expert is None else torch.full((12,), expert)
    return x, x[:, :1].sin(), route


def _mixture(rank: int, world: int, gather: str, sizes: tuple[int, int], routing: str, agreeing: int) -> dict[str, Any]:
    """``agreeing`` steps that route to both experts on every rank, then one step routed by ``routing``.

    ``routing``: ``"rank"`` (rank r's rows to expert r % 2), ``"reversed"`` (to expert 1 - r % 2) or,
    under HSDP, ``"replica"`` (to expert r // 2: each shard group agrees, the replicas do not).
    """
    from torch.distributed.fsdp import fully_shard

    expert = _expert_of(rank, routing)
    model = Experts(sizes)
    mesh = _world_mesh()
    fully_shard(model.shared, mesh=mesh)
    for part in model.experts:
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plain = Experts(sizes)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather=gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = torch.optim.SGD(plain.parameters(), lr=LR)

    def loss_fn(mb: Any) -> torch.Tensor:
        return nn.functional.mse_loss(model(mb[0], mb[2]), mb[1])

    error = None
    for i in range(agreeing + 1):
        chosen = None if i < agreeing else expert
        optimizer.zero_grad(set_to_none=True)
        try:
            step.backward(_routed_batch(i, rank, chosen), loss_fn)
        except RuntimeError as err:
            error = str(err)
            break
        optimizer.step()
        batches = [_routed_batch(i, r, None if i < agreeing else _expert_of(r, routing)) for r in range(world)]
        reference.zero_grad(set_to_none=True)
        x, y, route = (torch.cat(parts) for parts in zip(*batches, strict=True))
        nn.functional.mse_loss(plain(x, route), y).backward()
        reference.step()
    dist.barrier()  # every rank got here: none waits in a collective
    return {
        "error": error,
        "grads": [p.grad is None for p in model.parameters()],
        "weights": _relative_error(_full(model.parameters()), _full(plain.parameters())) if error is None else None,
    }


def _expert_of(rank: int, routing: str) -> int:
    return {"rank": rank % 2, "reversed": 1 - rank % 2, "replica": rank // 2}[routing]


SIZES = {"equal-experts": (16, 16), "different-experts": (16, 24)}
UNITS_NAMED = r"different FSDP2 collectives.*unit \d \('experts\.\d'\).*unit \d \('experts\.\d'\)"


@pytest.mark.parametrize("agreeing", [0, 2], ids=["guarded", "scripted"])
@pytest.mark.parametrize("routing", ["rank", "reversed"])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_ranks_routing_to_different_experts_raise_naming_both_units(
    ranks: RankPool, sizes: tuple[int, int], routing: str, agreeing: int
) -> None:
    """No rank trains a step whose experts' collectives would pair across ranks; each names both experts."""
    for result in ranks.run(_mixture, "module", sizes, routing, agreeing, timeout=90):
        assert result["error"] is not None and re.search(UNITS_NAMED, result["error"]), result["error"]
        messages = re.findall(r"unit \d \('(experts\.\d)'\)", result["error"])
        assert sorted(messages) == ["experts.0", "experts.1"]
        assert all(result["grads"])  # nothing reduced: no expert's gradient paired with the other's


@pytest.mark.parametrize("routing", ["rank", "replica"])
def test_hsdp_ranks_routing_to_different_experts_raise_on_every_rank(four_ranks: RankPool, routing: str) -> None:
    """``"replica"``: each shard group agrees, but the replicas' all-reduces would pair different experts."""
    for result in four_ranks.run(_mixture, "module", (16, 16), routing, 0, timeout=120):
        assert result["error"] is not None and re.search(UNITS_NAMED, result["error"]), result["error"]


@pytest.mark.parametrize("gather", ["attempt", "auto"])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_gathered_once_a_mixture_routed_differently_per_rank_trains_exactly(
    ranks: RankPool, gather: str, sizes: tuple[int, int]
) -> None:
    for result in ranks.run(_mixture, gather, sizes, "rank", 2, timeout=90):
        assert result["error"] is None and result["weights"] <= RTOL, result


# -- validation between training steps ------------------------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(12, 6, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(12, 1, generator=generator)


def _validating(rank: int, world: int, how: str, every: int) -> dict[str, Any]:
    """Seven training steps at split 3; after every ``every``-th, a validation ``how`` (``evaluate`` or ``no_grad``)."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for index in (0, 2, 4, 6):
        fully_shard(model[index], mesh=_world_mesh())
    fully_shard(model, mesh=_world_mesh())
    plain = _mlp()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = torch.optim.SGD(plain.parameters(), lr=LR)
    rounds, validation = [], []
    for i in range(7):
        optimizer.zero_grad(set_to_none=True)
        before = step.sync.guard.rounds
        step.backward(_batch(i, rank), lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
        step.optimizer_step(optimizer)
        rounds.append(step.sync.guard.rounds - before)
        x, y = (torch.cat(parts) for parts in zip(*(_batch(i, r) for r in range(world)), strict=True))
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        reference.step()
        if i % every == 0:
            held_out = _batch(100 + i, rank)[0]
            with torch.no_grad():
                if how == "evaluate":
                    out = step.evaluate(held_out, model, combine=lambda outputs, microbatches: torch.cat(outputs))
                else:
                    out = model(held_out)
                validation.append(_relative_error(out, plain(held_out)))
    return {
        "rounds": rounds,
        "scripts": step.sync.scripts.enabled,
        "error": _relative_error(_full(model.parameters()), _full(plain.parameters())),
        "validation": max(validation),
    }


@pytest.mark.parametrize("every", [1, 3], ids=["every-step", "every-3-steps"])
@pytest.mark.parametrize("how", ["evaluate", "no_grad"], ids=["step.evaluate", "bare-no_grad-forward"])
def test_validation_between_steps_leaves_the_training_script_in_use(ranks: RankPool, how: str, every: int) -> None:
    for result in ranks.run(_validating, how, every, timeout=120):
        # 4 units, 3 microbatches: the first two steps guard 36 collectives; every step adds the plan's round,
        # the vote and the optimizer step's agreement; then scripted, as with no validation
        assert result["rounds"] == [39, 39, 3, 3, 3, 3, 3]
        assert result["scripts"] is True
        assert result["error"] <= RTOL and result["validation"] <= RTOL, result


# -- tied weights in FSDP2's own layout --------------------------------------------------------------


class _Tied(nn.Module):
    """A token model whose output head is its embedding (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(12, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embedding(tokens))))


def _tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 12, (12, 5), generator=generator)
    return tokens, tokens.roll(1, dims=1)


def _tied(rank: int, world: int, gather: str) -> dict[str, Any]:
    """Four steps (the third and fourth scripted per module) of the tied model, FSDP2's layout for tied weights."""
    from torch.distributed.fsdp import fully_shard

    model = _Tied()
    fully_shard([model.embedding, model.head], mesh=_world_mesh())  # one unit for both: the weight is shared
    fully_shard(model.body, mesh=_world_mesh())
    fully_shard(model, mesh=_world_mesh())
    plain = _Tied()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather=gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = torch.optim.SGD(plain.parameters(), lr=LR)

    def loss(module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(module(tokens).flatten(0, 1), targets.flatten())

    for i in range(4):
        optimizer.zero_grad(set_to_none=True)
        step.backward(_tokens(i, rank), lambda mb: loss(model, *mb))
        step.optimizer_step(optimizer)
        tokens, targets = (torch.cat(parts) for parts in zip(*(_tokens(i, r) for r in range(world)), strict=True))
        reference.zero_grad(set_to_none=True)
        loss(plain, tokens, targets).backward()
        reference.step()
    return {"error": _relative_error(_full(model.parameters()), _full(plain.parameters()))}


@pytest.mark.parametrize("gather", ["module", "attempt", "auto"])
def test_tied_weights_in_fsdp2s_layout_train_exactly_under_every_gather(ranks: RankPool, gather: str) -> None:
    for result in ranks.run(_tied, gather, timeout=90):
        assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"
