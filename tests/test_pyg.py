"""PyTorch Geometric as a client: its DataLoader wrapped as it is, its ``Batch`` split by graph.

A two-layer GCN (``torch_geometric.nn.GCNConv``) on small random graphs, trained through
``MicrobatchingDataLoader(torch_geometric.loader.DataLoader(...))`` and ``ElasticStep``: the
gradient of a per-graph mean loss (graph classification) and of a node-mean loss (node
classification, ``count_fn=num_nodes``) equals the full batch's within 1e-5 relative, at any
split and after OOM retries (injected, raised by the test's own code, and from a simulated
device).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget, inject_oom

pyg_data = pytest.importorskip("torch_geometric.data")
pyg_loader = pytest.importorskip("torch_geometric.loader")
pyg_nn = pytest.importorskip("torch_geometric.nn")

RTOL = 1e-5
FEATURES, CLASSES = 6, 3


def _graphs(count: int = 24, seed: int = 0) -> list[Any]:
    """Random graphs of 3 to 12 nodes, each with a graph label and node labels."""
    generator = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(count):
        nodes = int(torch.randint(3, 13, (), generator=generator))
        edges = torch.randint(nodes, (2, 3 * nodes), generator=generator)
        graphs.append(
            pyg_data.Data(
                x=torch.randn(nodes, FEATURES, generator=generator),
                edge_index=torch.cat([edges, edges.flip(0)], dim=1),
                y=torch.randint(CLASSES, (1,), generator=generator),
                node_y=torch.randint(CLASSES, (nodes,), generator=generator),
            )
        )
    return graphs


class GCN(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = pyg_nn.GCNConv(FEATURES, 32)
        self.conv2 = pyg_nn.GCNConv(32, 32)
        self.head = nn.Linear(32, CLASSES)

    def nodes(self, batch: Any) -> torch.Tensor:
        x = torch.relu(self.conv1(batch.x, batch.edge_index))
        return torch.relu(self.conv2(x, batch.edge_index))

    def graph_loss(self, batch: Any) -> torch.Tensor:
        """Mean over the batch's graphs: the default row weights are exact."""
        pooled = pyg_nn.global_mean_pool(self.nodes(batch), batch.batch, size=batch.num_graphs)
        return F.cross_entropy(self.head(pooled), batch.y)

    def node_loss(self, batch: Any) -> torch.Tensor:
        """Mean over the batch's nodes: needs ``count_fn=num_nodes``."""
        return F.cross_entropy(self.head(self.nodes(batch)), batch.node_y)


def _num_nodes(batch: Any) -> int:
    return int(batch.num_nodes)


def _reference(model: GCN, batch: Any, kind: str) -> list[torch.Tensor]:
    reference = copy.deepcopy(model)
    getattr(reference, f"{kind}_loss")(batch).backward()
    return [p.grad for p in reference.parameters()]


def _relative_error(model: nn.Module, reference: list[torch.Tensor]) -> float:
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([g.flatten() for g in reference])
    return float((got - want).norm() / want.norm())


def _loader(batch_size: int = 16, **kwargs: Any) -> Any:
    return pyg_loader.DataLoader(_graphs(), batch_size=batch_size, **kwargs)


# -- the loader ---------------------------------------------------------------------------------


def test_wraps_pyg_dataloader_and_cuts_its_batches_by_graph() -> None:
    eb.register_pyg_batch()
    plain = _loader(shuffle=True, generator=torch.Generator().manual_seed(3))
    loader = eb.MicrobatchingDataLoader(plain, controller=eb.SplitController(split_count=3))
    batches = list(loader)
    assert [len(b) for b in batches] == [16, 8]
    expected = list(_loader(shuffle=True, generator=torch.Generator().manual_seed(3)))
    for batch, want in zip(batches, expected, strict=True):
        pieces = [mb.unwrap() for mb in batch.microbatches()]
        assert [p.num_graphs for p in pieces] == [len(batch) // 3 + (i < len(batch) % 3) for i in range(3)]
        assert isinstance(pieces[0], pyg_data.Batch)
        assert torch.equal(torch.cat([p.x for p in pieces]), want.x)
        assert torch.equal(torch.cat([p.y for p in pieces]), want.y)
        assert sum(p.num_nodes for p in pieces) == want.num_nodes


def test_a_microbatch_keeps_the_loaders_follow_batch() -> None:
    eb.register_pyg_batch()
    loader = eb.MicrobatchingDataLoader(_loader(batch_size=6, follow_batch=["node_y"]))
    first, second = next(iter(loader)).microbatches(2)
    whole = next(iter(_loader(batch_size=6, follow_batch=["node_y"])))
    assert torch.equal(first.unwrap().node_y_batch, whole.node_y_batch[: first.unwrap().num_nodes])
    assert second.unwrap().node_y_batch.max() == 2  # graphs 0..2 of the second microbatch


def test_an_unregistered_pyg_batch_names_the_class_to_register() -> None:
    loader = eb.MicrobatchingDataLoader(_loader())
    with pytest.raises(
        TypeError,
        match=r"DataBatch \(made at run time from torch_geometric\.data\.batch\.Batch\): register PyG's batches once "
        r"with elastic_batches\.register_pyg_batch\(\)",
    ):
        next(iter(loader))


def test_register_pyg_batch_twice_changes_nothing() -> None:
    eb.register_pyg_batch()
    eb.register_pyg_batch()
    batch = eb.ElasticBatch.wrap(next(iter(_loader(batch_size=4))))
    assert [mb.unwrap().num_graphs for mb in batch.microbatches(2)] == [2, 2]


# -- exact gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 5, 16], ids=lambda c: f"count{c}")
@pytest.mark.parametrize("kind", ["graph", "node"])
def test_gcn_gradient_equals_the_full_batch_at_any_split(kind: str, count: int) -> None:
    eb.register_pyg_batch()
    whole = next(iter(_loader()))
    model = GCN()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=count))
    count_fn = _num_nodes if kind == "node" else None
    batch = next(iter(eb.MicrobatchingDataLoader(_loader(), controller=step.controller)))
    loss = step.backward(batch, getattr(model, f"{kind}_loss"), count_fn=count_fn)
    assert _relative_error(model, _reference(model, whole, kind)) < RTOL
    assert torch.allclose(loss, getattr(model, f"{kind}_loss")(whole).detach(), rtol=RTOL)


def test_a_node_mean_weighted_by_graphs_is_wrong() -> None:
    eb.register_pyg_batch()
    whole = next(iter(_loader()))
    model = GCN()
    eb.ElasticStep(model, controller=eb.SplitController(split_count=4)).backward(whole, model.node_loss)
    assert _relative_error(model, _reference(model, whole, "node")) > 1e-3  # count_fn is what makes it exact


@pytest.mark.parametrize(
    ("layer", "phase", "calls"),
    [("conv1", "forward", [0]), ("conv2", "forward", [1, 3]), ("conv1", "backward", [1])],
    ids=["conv1-forward-first", "conv2-forward-twice", "conv1-backward-second"],
)
@pytest.mark.parametrize("kind", ["graph", "node"])
def test_gcn_gradient_stays_exact_after_injected_ooms(kind: str, layer: str, phase: str, calls: list[int]) -> None:
    eb.register_pyg_batch()
    whole = next(iter(_loader()))
    model = GCN()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    target = model.get_submodule(layer)
    count_fn = _num_nodes if kind == "node" else None
    loss_fn = model.graph_loss if kind == "graph" else model.node_loss
    with inject_oom(target, phase=phase, calls=calls) as oom:
        batch = next(iter(eb.MicrobatchingDataLoader(_loader(), controller=step.controller)))
        step.backward(batch, lambda b: loss_fn(b), count_fn=count_fn)
    assert oom.fired == len(calls) and step.controller.oom_count == len(calls)
    assert _relative_error(model, _reference(model, whole, kind)) < RTOL


def test_an_oom_raised_by_the_loss_on_large_microbatches_is_retried_exactly() -> None:
    """The test's own code raises torch.OutOfMemoryError whenever a microbatch holds more than 40 nodes."""
    eb.register_pyg_batch()
    whole = next(iter(_loader()))
    model = GCN()
    step = eb.ElasticStep(model)
    sizes: list[int] = []

    def loss_fn(batch: Any) -> torch.Tensor:
        sizes.append(batch.num_nodes)
        if batch.num_nodes > 40:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {batch.num_nodes} nodes do not fit")
        return model.node_loss(batch)

    step.backward(
        next(iter(eb.MicrobatchingDataLoader(_loader(), controller=step.controller))), loss_fn, count_fn=_num_nodes
    )
    assert step.controller.oom_count >= 1 and sizes[0] == whole.num_nodes
    assert _relative_error(model, _reference(model, whole, "node")) < RTOL


def test_training_under_a_simulated_device_matches_full_batch_training() -> None:
    eb.register_pyg_batch()
    elastic, plain = GCN(), GCN()
    loader = eb.MicrobatchingDataLoader(_loader(shuffle=True, generator=torch.Generator().manual_seed(1)))
    step = eb.ElasticStep(elastic, controller=loader.controller, memory=None)  # the OOM-driven search under the budget
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (elastic, plain)]
    with MemoryBudget() as measure:
        elastic.graph_loss(next(iter(_loader()))).backward()
    elastic.zero_grad(set_to_none=True)
    budget = MemoryBudget(limit_bytes=measure.peak_bytes // 3)
    for _ in range(2):
        for batch in loader:
            with budget:
                step.backward(batch, elastic.graph_loss)
                optimizers[0].step()
                optimizers[0].zero_grad(set_to_none=True)
    reference_loader = _loader(shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for batch in reference_loader:
            plain.graph_loss(batch).backward()
            optimizers[1].step()
            optimizers[1].zero_grad(set_to_none=True)
    assert budget.oom_count >= 1 and loader.controller.split_count > 1
    for p, q in zip(elastic.state_dict().values(), plain.state_dict().values(), strict=True):
        assert float((p - q).abs().max() / q.abs().max()) < RTOL, "weights differ from full-batch training"


def test_step_device_moves_the_graphs_of_each_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    eb.register_pyg_batch()
    moved: list[str] = []
    original = pyg_data.Data.to

    def to(self: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        moved.append(str(device))
        return original(self, device, *args, **kwargs)

    monkeypatch.setattr(pyg_data.Data, "to", to)
    model = GCN()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2), device="cpu")
    batch = next(iter(eb.MicrobatchingDataLoader(_loader(batch_size=6), controller=step.controller)))
    step.backward(batch, model.graph_loss)
    assert moved == ["cpu"] * 6  # each graph once, as its microbatch is moved


def test_moving_a_microbatch_leaves_the_users_graphs_where_they_were() -> None:
    # PyG's Data.to moves the object itself: a moved microbatch must hold copies, or the dataset ends up on the device
    graphs = _graphs(count=4)
    batch = eb.ElasticBatch.wrap({"graph": graphs, "y": torch.arange(4.0)})  # Data objects as per-sample values
    moved = [mb.to("meta") for mb in batch.microbatches(2)]
    assert [g.x.device.type for mb in moved for g in mb.unwrap()["graph"]] == ["meta"] * 4
    assert [g.x.device.type for g in graphs] == ["cpu"] * 4

    model = nn.Linear(FEATURES, 1)
    received: list[Any] = []

    def loss_fn(mb: Any) -> torch.Tensor:
        received.extend(mb["graph"])
        return torch.stack([model(g.x).mean() for g in mb["graph"]]).mean()

    eb.ElasticStep(model, controller=eb.SplitController(split_count=2), device="cpu", memory=None).backward(
        batch, loss_fn
    )
    assert len(received) == 4 and not any(got is mine for got, mine in zip(received, graphs, strict=True))
