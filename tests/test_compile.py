"""``ShapeBuckets`` keep a ``torch.compile``d model's recompiles bounded, and the gradient exact.

The model is compiled with ``dynamic=False`` (every new input shape compiles a new graph, as
with CUDA graphs) and a backend that only counts compilations, so the test is fast on a CPU.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import elastic_batches as eb

PAD = {"input_ids": 0, "labels": -100}
VOCAB = 32


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = nn.Linear(8, VOCAB, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def make_samples(rows: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(rows):
        length = max(2, int(math.exp(math.log(12) + 0.8 * torch.randn((), generator=generator).item())))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        samples.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
    return samples


def count_tokens(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"] != -100).sum()


def train_compiled(samples: list[dict[str, torch.Tensor]], buckets: eb.ShapeBuckets | None) -> dict[str, Any]:
    torch._dynamo.reset()
    counter = CompileCounter()
    model = TokenModel()
    compiled = torch.compile(model, backend=counter, dynamic=False)
    loader = eb.MicrobatchingDataLoader(
        samples, batch_size=8, pad_values=PAD, shape_buckets=buckets, controller=eb.SplitController(split_count=3)
    )
    step = eb.ElasticStep(model, controller=loader.controller)
    shapes = set()

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        shapes.add(tuple(mb["input_ids"].shape))
        logits = compiled(mb["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)

    grads = []
    for batch in loader:
        step.backward(batch, loss_fn, count_fn=count_tokens)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return {"compiles": counter.frame_count, "shapes": shapes, "grads": grads, "model": model}


def reference_grads(model: nn.Module, samples: list[dict[str, torch.Tensor]]) -> list[list[torch.Tensor]]:
    out = []
    for start in range(0, len(samples), 8):
        reference = copy.deepcopy(model)
        whole = eb.ElasticCollate(pad_values=PAD)(samples[start : start + 8]).unwrap()
        logits = reference(whole["input_ids"])
        F.cross_entropy(logits.flatten(0, 1), whole["labels"].flatten(), ignore_index=-100).backward()
        out.append([p.grad for p in reference.parameters()])
    return out


@pytest.fixture(autouse=True)
def _room_for_every_recompile() -> Any:
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "buckets",
    [eb.ShapeBuckets(lengths="pow2", rows=4), eb.ShapeBuckets(lengths=16, rows="pow2")],
    ids=["pow2-lengths-rows4", "lengths16-pow2-rows"],
)
def test_shape_buckets_bound_recompiles_and_keep_the_gradient_exact(buckets: eb.ShapeBuckets) -> None:
    samples = make_samples(48, seed=1)
    plain = train_compiled(samples, None)
    bucketed = train_compiled(samples, buckets)
    rows = {buckets.round_rows(r) for r in (2, 3)}  # 8 rows in 3 pieces: 3, 3, 2
    longest = max(len(s["input_ids"]) for s in samples)
    lengths = {buckets.round_length(n) for n in range(1, longest + 1)}
    assert {r for r, _ in bucketed["shapes"]} <= rows and {n for _, n in bucketed["shapes"]} <= lengths
    assert bucketed["compiles"] == len(bucketed["shapes"]) <= len(rows) * len(lengths)  # the bound, whatever the data
    assert plain["compiles"] == len(plain["shapes"]) > 2 * bucketed["compiles"]
    for got, want in zip(bucketed["grads"], reference_grads(bucketed["model"], samples), strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-12)
