"""Variable-length batches end to end: exact token-mean gradients with ``count_fn`` (any split, after
OOM retries, across 2 gloo ranks), the tokens controller under simulated memory, custom collate
registration through ``spawn`` workers, tensorclass batches, strings per sample, and the example.

The reference for every gradient is one token-mean loss over the whole batch (both ranks'
samples in the distributed case), padded to its longest sample and computed in one piece.
The model is causal, so right padding never changes a real position's output.
"""

from __future__ import annotations

import copy
import math
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensordict import tensorclass
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget, inject_oom

from support.ranks import RankPool

RTOL = 1e-5
PAD = {"input_ids": 0, "labels": -100}
VOCAB = 40
ROOT = Path(__file__).resolve().parent.parent


class TinyCausalLM(nn.Module):
    """Embedding, a causal running mean, a head: position t sees tokens 0..t only."""

    def __init__(self, dim: int = 16, vocab: int = VOCAB, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        positions = torch.arange(1, ids.shape[1] + 1, dtype=x.dtype, device=x.device)
        context = x.cumsum(1) / positions[:, None]
        return self.head(torch.tanh(self.mix(context)) + x)


def make_samples(rows: int, seed: int, mean_length: float = 12.0) -> list[dict[str, Any]]:
    """Dict samples: token ids of log-normal lengths, next-token labels with a masked prompt, the text."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        length = max(2, int(math.exp(math.log(mean_length) + 0.7 * torch.randn((), generator=generator).item())))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        labels[: int(torch.randint(0, length // 2 + 1, (), generator=generator))] = -100  # the prompt
        text = " ".join(str(t) for t in ids.tolist())
        samples.append({"input_ids": ids, "labels": labels, "text": text, "row": seed * 1000 + i})
    return samples


def token_mean_loss(model: nn.Module):
    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        logits = model(mb["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)

    return loss_fn


def count_tokens(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"] != -100).sum()


def reference_grads(model: nn.Module, samples: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Gradient of one token-mean loss over all ``samples``, padded to the longest, in one piece."""
    reference = copy.deepcopy(model)
    whole = eb.ElasticCollate(pad_values=PAD, sort_by_length=False)(samples).unwrap()
    token_mean_loss(reference)(whole).backward()
    return [p.grad for p in reference.parameters()]


def relative_error(model: nn.Module, reference: list[torch.Tensor]) -> float:
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([g.flatten() for g in reference])
    return float((got - want).norm() / want.norm())


# -- exact token-mean gradients -----------------------------------------------------------------


@pytest.mark.parametrize("unit", ["rows", "tokens"])
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 16], ids=lambda c: f"count{c}")
def test_count_fn_gives_the_token_mean_gradient_with_any_split(unit: str, count: int) -> None:
    samples = make_samples(16, seed=count)
    model = TinyCausalLM()
    batch = eb.ElasticCollate(pad_values=PAD)(samples)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=count, unit=unit))
    loss = step.backward(batch, token_mean_loss(model), count_fn=count_tokens)
    assert relative_error(model, reference_grads(model, samples)) < RTOL
    whole = eb.ElasticCollate(pad_values=PAD)(samples).unwrap()
    assert torch.allclose(loss, token_mean_loss(model)(whole).detach(), rtol=RTOL)


def test_averaging_per_microbatch_means_is_the_accumulation_bug() -> None:
    samples = make_samples(16, seed=3)
    model = TinyCausalLM()
    batch = eb.ElasticCollate(pad_values=PAD)(samples)
    eb.ElasticStep(model, controller=eb.SplitController(split_count=4)).backward(batch, token_mean_loss(model))
    assert relative_error(model, reference_grads(model, samples)) > 1e-3  # rows weights: not a token mean


@pytest.mark.parametrize(
    ("phase", "calls"),
    [("forward", [0]), ("forward", [1, 3]), ("backward", [0]), ("backward", [1])],
    ids=["forward-first", "forward-twice", "backward-first", "backward-second"],
)
@pytest.mark.parametrize("unit", ["rows", "tokens"])
def test_count_fn_stays_exact_after_oom_retries(unit: str, phase: str, calls: list[int]) -> None:
    samples = make_samples(16, seed=7)
    model = TinyCausalLM()
    batch = eb.ElasticCollate(pad_values=PAD)(samples)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2, unit=unit))
    target = model.embed if phase == "backward" else model  # backward: later layers already have grads
    with inject_oom(target, phase=phase, calls=calls) as oom:
        step.backward(batch, token_mean_loss(model), count_fn=count_tokens)
    assert oom.fired == len(calls) and step.controller.oom_count == len(calls)
    assert relative_error(model, reference_grads(model, samples)) < RTOL


def test_count_fn_keeps_an_outer_accumulation_across_batches() -> None:
    first, second = make_samples(8, seed=1), make_samples(8, seed=2)
    model = TinyCausalLM()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3, unit="tokens"))
    with inject_oom(model, phase="forward", calls=[4]):
        for samples in (first, second):
            step.backward(eb.ElasticCollate(pad_values=PAD)(samples), token_mean_loss(model), count_fn=count_tokens)
    want = [a + b for a, b in zip(reference_grads(model, first), reference_grads(model, second), strict=True)]
    assert relative_error(model, want) < RTOL


# -- 2 gloo ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("ranks"), world_size=2)
    yield pool
    pool.close()


def _rank_samples(rank: int) -> list[dict[str, Any]]:
    # rank 0: 10 long samples; rank 1: 6 short ones: different rows and very different token counts
    return make_samples(10, seed=100, mean_length=24.0) if rank == 0 else make_samples(6, seed=101, mean_length=6.0)


def _token_mean_on_two_ranks(rank: int, world_size: int, unit: str, oom_rank: int | None) -> dict[str, float]:
    model = TinyCausalLM()
    ddp = nn.parallel.DistributedDataParallel(model)
    step = eb.ElasticStep(ddp, controller=eb.SplitController(split_count=2, unit=unit))
    batch = eb.ElasticCollate(pad_values=PAD)(_rank_samples(rank))
    calls = [1] if rank == oom_rank else [10_000]
    with inject_oom(model, phase="forward", calls=calls):
        step.backward(batch, token_mean_loss(ddp), count_fn=count_tokens)
    union = _rank_samples(0) + _rank_samples(1)
    return {
        "error": relative_error(model, reference_grads(model, union)),
        "tokens": float(count_tokens(batch.unwrap())),
        "ooms": float(step.controller.oom_count),
    }


@pytest.mark.parametrize(("unit", "oom_rank"), [("rows", None), ("tokens", None), ("tokens", 1), ("rows", 0)], ids=str)
def test_count_fn_is_exact_across_two_ranks_with_different_token_counts(
    ranks: RankPool, unit: str, oom_rank: int | None
) -> None:
    results = ranks.run(_token_mean_on_two_ranks, unit, oom_rank, timeout=60)
    assert results[0]["tokens"] > 3 * results[1]["tokens"]
    for result in results:
        assert result["error"] < RTOL
        assert result["ooms"] == (0 if oom_rank is None else 1)  # every rank learned of the OOM


# -- the tokens controller under simulated memory -----------------------------------------------


def _train_stream(unit: str, limit: int, stream: list[list[dict[str, Any]]]) -> tuple[list[int], list[int]]:
    model = TinyCausalLM(dim=256, vocab=64, dtype=torch.float32)
    step = eb.ElasticStep(model, controller=eb.SplitController(unit=unit), memory=None)  # OOMs teach it, not a probe
    budget = MemoryBudget(limit_bytes=limit)
    ooms, counts = [], []
    for samples in stream:
        batch = eb.ElasticCollate(pad_values=PAD)(samples)
        before = step.controller.oom_count
        with budget:
            step.backward(batch, token_mean_loss(model), count_fn=count_tokens)
        model.zero_grad(set_to_none=True)
        ooms.append(step.controller.oom_count - before)
        counts.append(step.controller.split_count)
    return ooms, counts


def _stream() -> list[list[dict[str, Any]]]:
    short = [make_samples(16, seed=s, mean_length=8.0) for s in range(4)]
    long = [make_samples(16, seed=10 + s, mean_length=32.0) for s in range(2)]
    return short + long


def _limit_for_tokens(tokens: int) -> int:
    """Bytes a microbatch of about ``tokens`` padded positions needs, measured with an unlimited budget."""
    model = TinyCausalLM(dim=256, vocab=64, dtype=torch.float32)
    ids = torch.randint(1, 64, (1, tokens))
    with MemoryBudget() as budget:
        token_mean_loss(model)({"input_ids": ids, "labels": ids}).backward()
    return budget.peak_bytes


def test_a_batch_of_longer_sequences_gets_more_microbatches_without_an_oom() -> None:
    stream = _stream()
    limit = _limit_for_tokens(160)
    ooms, counts = _train_stream("tokens", limit, stream)
    assert sum(ooms[:4]) >= 1  # learned on the short batches
    assert ooms[4:] == [0, 0]  # the longer batches were split further before they ran
    assert min(counts[4:]) > max(counts[:4])
    rows_ooms, _ = _train_stream("rows", limit, stream)
    assert sum(rows_ooms[4:]) >= 1  # a row count learned on short batches does not fit long ones


# -- custom types, tensorclasses, strings -------------------------------------------------------


class Span:
    """A user sample type: a (start, stop) pair of character offsets."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop


class Spans:
    """What ``collate_spans`` makes of a list of ``Span``: a user batch type the library cannot split itself."""

    def __init__(self, bounds: torch.Tensor) -> None:
        self.bounds = bounds


def collate_spans(spans: list[Span], *, collate_fn_map: Any = None) -> Spans:
    return Spans(torch.tensor([[s.start, s.stop] for s in spans]))


def spans_to_fields(spans: Spans) -> dict[str, torch.Tensor]:
    return {"bounds": spans.bounds}


def spans_from_fields(fields: dict[str, Any]) -> Spans:
    return Spans(fields["bounds"])


class SpanDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.samples[index])
        sample["span"] = Span(index, index + len(sample["text"]))
        return sample


def test_a_registered_user_type_round_trips_through_spawn_workers_to_loss_fn() -> None:
    eb.register_collate(Span, collate_spans)
    eb.register_batch_type(Spans, to_tensordict=spans_to_fields, from_tensordict=spans_from_fields)
    samples = make_samples(8, seed=5)
    loader = eb.MicrobatchingDataLoader(
        SpanDataset(samples),
        batch_size=8,
        pad_values=PAD,
        num_workers=1,
        multiprocessing_context="spawn",
        controller=eb.SplitController(split_count=3),
    )
    seen = []

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        assert isinstance(mb["span"], Spans)
        for (start, stop), text, ids in zip(mb["span"].bounds.tolist(), mb["text"], mb["input_ids"], strict=True):
            assert stop - start == len(text) and text == samples[start]["text"]
            assert ids[: len(samples[start]["input_ids"])].tolist() == samples[start]["input_ids"].tolist()
        seen.extend(mb["span"].bounds[:, 0].tolist())
        return model(mb["input_ids"]).mean()

    model = TinyCausalLM()
    batch = next(iter(loader))
    eb.ElasticStep(model, controller=loader.controller).backward(batch, loss_fn)
    assert sorted(seen) == list(range(8))


@tensorclass
class TokenBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor


def collate_token_batch(samples: list[dict[str, Any]]) -> TokenBatch:
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence([s["labels"] for s in samples], batch_first=True, padding_value=-100)
    return TokenBatch(input_ids=ids, labels=labels, batch_size=[len(samples)])


def test_a_tensorclass_batch_reaches_loss_fn_as_the_tensorclass() -> None:
    samples = make_samples(12, seed=9)
    controller = eb.SplitController(split_count=3)
    loader = eb.MicrobatchingDataLoader(samples, batch_size=12, collate_fn=collate_token_batch, controller=controller)
    model = TinyCausalLM()
    step = eb.ElasticStep(model, controller=controller)
    types = []

    def loss_fn(mb: TokenBatch) -> torch.Tensor:
        types.append(type(mb))
        return token_mean_loss(model)({"input_ids": mb.input_ids, "labels": mb.labels})

    step.backward(next(iter(loader)), loss_fn, count_fn=lambda mb: (mb.labels != -100).sum())
    assert types == [TokenBatch] * 3
    assert relative_error(model, reference_grads(model, samples)) < RTOL


def test_a_tensorclass_field_next_to_padded_fields() -> None:
    @tensorclass
    class Weights:
        value: torch.Tensor

    def collate_fn(samples: list[dict[str, Any]]) -> dict[str, Any]:
        rows = torch.tensor([s["row"] for s in samples], dtype=torch.float64)
        return {"weights": Weights(value=rows, batch_size=[len(samples)]), "text": [s["text"] for s in samples]}

    samples = make_samples(6, seed=4)
    batch = eb.ElasticCollate(collate_fn, pad_values=PAD)(samples)
    for mb in batch.microbatches(2):
        out = mb.unwrap()
        assert isinstance(out["weights"], Weights)
        for row, text in zip(out["weights"].value.tolist(), out["text"], strict=True):
            assert text == samples[int(row) - 4000]["text"]


def test_raw_strings_per_sample_follow_their_token_ids_into_each_microbatch() -> None:
    samples = make_samples(10, seed=6)
    loader = eb.MicrobatchingDataLoader(samples, batch_size=10, pad_values=PAD)
    for mb in next(iter(loader)).microbatches(4, balance="tokens"):
        out = mb.unwrap()
        for text, ids in zip(out["text"], out["input_ids"], strict=True):
            words = text.split(" ")
            assert ids[: len(words)].tolist() == [int(w) for w in words]
            assert (ids[len(words) :] == 0).all()
        assert out["input_ids"].shape[1] == max(len(t.split(" ")) for t in out["text"])


# -- the example --------------------------------------------------------------------------------


def test_causal_lm_example_runs_quick() -> None:
    example = runpy.run_path(str(ROOT / "examples" / "causal_lm.py"), run_name="causal_lm_example")
    summary = example["main"](quick=True)
    # memory="auto" measures with the active MemoryBudget: the split is predicted, at most 1 OOM to settle
    assert summary["ooms"] <= 1 and summary["max_split_count"] > 1
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["gradient_error"] < RTOL
