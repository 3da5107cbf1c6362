"""Hugging Face transformers as a client: real models built from a config, HF's own collators.

A tiny GPT-2 (``GPT2LMHeadModel``), a tiny BERT for sequence classification and for masked LM,
batches from ``DataCollatorWithPadding`` and ``DataCollatorForLanguageModeling`` (dynamic masking
included) kept as the collate function through :class:`elastic_batches.TrimPadding`, the loss from
``outputs.loss``. With any split and after OOM retries (injected, raised by the test's own code,
from a simulated device) the gradient equals the full batch's within 1e-5 relative; each
microbatch is cut to its own longest row. No download: the tokenizer is a word-level one built
here, the models come from configs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget, inject_oom

from support.hf_models import SPECIAL, WORDS, make_tokenizer, tiny_bert, tiny_gpt2

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers() -> Any:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config notes about token ids of the tiny vocabularies
    yield
    transformers.logging.set_verbosity(verbosity)


def encoded_texts(tokenizer: Any, rows: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """Tokenized random texts of 1 to 24 words, with a class label each."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        words = torch.randint(len(WORDS), (int(torch.randint(1, 25, (), generator=generator)),), generator=generator)
        encoded = tokenizer(" ".join(WORDS[w] for w in words.tolist()))
        samples.append({**encoded, "label": i % 3})
    return samples


def without_labels(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "label"} for s in samples]


def hf_loss(model: nn.Module) -> Any:
    def loss_fn(mb: Any) -> torch.Tensor:
        return model(**mb).loss

    return loss_fn


def reference_grads(model: nn.Module, whole: Any) -> list[torch.Tensor]:
    """The gradient of ``outputs.loss`` over the whole batch, as collated, in one piece."""
    reference = copy.deepcopy(model)
    reference(**whole).loss.backward()
    return [p.grad for p in reference.parameters()]


def relative_error(model: nn.Module, reference: list[torch.Tensor]) -> float:
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    want = torch.cat([g.flatten() for g in reference if g is not None])
    return float((got - want).norm() / want.norm())


# The three clients: model, collator, samples, count_fn (None: rows, for the sequence classifier).
def client(name: str, tokenizer: Any) -> tuple[nn.Module, Any, list[dict[str, Any]], Any]:
    samples = encoded_texts(tokenizer)
    if name == "gpt2":
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        return tiny_gpt2(), collator, without_labels(samples), eb.label_count(causal=True)
    if name == "bert-classify":
        return tiny_bert("classify"), transformers.DataCollatorWithPadding(tokenizer), samples, None
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)
    return tiny_bert("mlm"), collator, without_labels(samples), eb.label_count(causal=False)


CLIENTS = ["gpt2", "bert-classify", "bert-mlm"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def first_batch(collator: Any, samples: list[dict[str, Any]], controller: eb.SplitController) -> eb.ElasticBatch:
    """The loader's first batch; the loader shares the step's controller, as in training."""
    torch.manual_seed(1)  # the masks DataCollatorForLanguageModeling draws
    trim = eb.TrimPadding(collator)
    loader = eb.MicrobatchingDataLoader(samples, batch_size=len(samples), collate_fn=trim, controller=controller)
    return next(iter(loader))


# -- exact gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3, 16], ids=lambda c: f"count{c}")  # whole, uneven pieces, a row each
@pytest.mark.parametrize("name", CLIENTS)
def test_gradient_equals_the_full_batch_at_any_split(tokenizer: Any, name: str, count: int) -> None:
    model, collator, samples, count_fn = client(name, tokenizer)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=count))
    batch = first_batch(collator, samples, step.controller)
    loss = step.backward(batch, hf_loss(model), count_fn=count_fn)
    whole = batch.unwrap()
    assert relative_error(model, reference_grads(model, whole)) < RTOL
    assert torch.allclose(loss, model(**whole).loss.detach(), rtol=RTOL)


@pytest.mark.parametrize(
    ("phase", "calls"), [("forward", [0]), ("forward", [1, 3]), ("backward", [1])], ids=["fwd0", "fwd1-3", "bwd1"]
)
@pytest.mark.parametrize("name", CLIENTS)
def test_gradient_stays_exact_after_injected_ooms(tokenizer: Any, name: str, phase: str, calls: list[int]) -> None:
    model, collator, samples, count_fn = client(name, tokenizer)
    layers = model.transformer.h if name == "gpt2" else model.bert.encoder.layer
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    batch = first_batch(collator, samples, step.controller)
    with inject_oom(layers[0] if phase == "backward" else layers[1], phase=phase, calls=calls) as oom:
        step.backward(batch, hf_loss(model), count_fn=count_fn)
    assert oom.fired == len(calls) and step.controller.oom_count == len(calls)
    assert relative_error(model, reference_grads(model, batch.unwrap())) < RTOL


@pytest.mark.parametrize("name", CLIENTS)
def test_an_oom_raised_by_the_loss_past_a_token_count_is_retried_exactly(tokenizer: Any, name: str) -> None:
    """The test's own code raises torch.OutOfMemoryError for microbatches of more than 64 padded positions."""
    model, collator, samples, count_fn = client(name, tokenizer)
    step = eb.ElasticStep(model)
    batch = first_batch(collator, samples, step.controller)
    shapes: list[tuple[int, ...]] = []

    def loss_fn(mb: Any) -> torch.Tensor:
        shapes.append(tuple(mb["input_ids"].shape))
        if mb["input_ids"].numel() > 64:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {tuple(mb['input_ids'].shape)} does not fit")
        return model(**mb).loss

    step.backward(batch, loss_fn, count_fn=count_fn)
    assert step.controller.oom_count >= 2 and shapes[0] == tuple(batch.unwrap()["input_ids"].shape)
    assert relative_error(model, reference_grads(model, batch.unwrap())) < RTOL


def test_the_naive_token_count_of_a_causal_lm_is_off_by_percents(tokenizer: Any) -> None:
    """``labels != -100`` counts one label per row that the shifted loss never sees."""
    model, collator, samples, _ = client("gpt2", tokenizer)
    controller = eb.SplitController(split_count=4)
    batch = first_batch(collator, samples, controller)
    errors = []
    for count_fn in (eb.label_count(causal=False), eb.label_count(causal=True)):
        trained = copy.deepcopy(model)
        eb.ElasticStep(trained, controller=controller).backward(batch, hf_loss(trained), count_fn=count_fn)
        errors.append(relative_error(trained, reference_grads(model, batch.unwrap())))
    naive, exact = errors
    assert naive > 1e-2 and exact < RTOL  # measured: 1.7e-2 to 7.5e-2 naive, ~1.5e-7 exact


def test_training_under_a_simulated_device_matches_full_batch_training(tokenizer: Any) -> None:
    samples = without_labels(encoded_texts(tokenizer, rows=32, seed=3))
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    elastic, plain = tiny_gpt2(), tiny_gpt2()
    loader = eb.MicrobatchingDataLoader(samples, batch_size=16, collate_fn=eb.TrimPadding(collator))
    step = eb.ElasticStep(elastic, controller=loader.controller, memory=None)  # the OOM-driven search
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (elastic, plain)]
    whole = collator(samples[:16])
    with MemoryBudget() as measure:
        elastic(**whole).loss.backward()
    elastic.zero_grad(set_to_none=True)
    budget = MemoryBudget(limit_bytes=measure.peak_bytes // 2)
    references = []
    for batch in loader:
        references.append(batch.unwrap())  # the batch as the collator made it (sorted rows), before any cut
        with budget:
            step.backward(batch, hf_loss(elastic), count_fn=eb.label_count(causal=True))
            optimizers[0].step()
            optimizers[0].zero_grad(set_to_none=True)
    for whole in references:
        plain(**whole).loss.backward()
        optimizers[1].step()
        optimizers[1].zero_grad(set_to_none=True)
    assert budget.oom_count >= 1 and loader.controller.split_count > 1
    for p, q in zip(elastic.parameters(), plain.parameters(), strict=True):
        assert float((p.detach() - q.detach()).abs().max() / q.detach().abs().max()) < RTOL


# -- the collator is kept, each microbatch is trimmed -----------------------------------------


@pytest.mark.parametrize("name", CLIENTS)
def test_each_microbatch_is_cut_to_its_own_longest_row(tokenizer: Any, name: str) -> None:
    _, collator, samples, _ = client(name, tokenizer)
    batch = first_batch(collator, samples, eb.SplitController())
    whole = batch.unwrap()
    assert type(whole) is transformers.BatchEncoding  # the collator's own structure reaches loss_fn
    widths = []
    for mb in batch.microbatches(4):
        piece = mb.unwrap()
        longest = int(piece["attention_mask"].sum(1).max())
        assert piece["input_ids"].shape[1] == piece["attention_mask"].shape[1] == longest
        if name != "bert-classify":
            assert piece["labels"].shape == piece["input_ids"].shape
        else:
            assert piece["labels"].shape == (len(mb),)  # one label per row: not trimmed
        widths.append(longest)
    assert widths == sorted(widths, reverse=True) and widths[-1] < whole["input_ids"].shape[1]


def test_dynamic_masking_is_the_collators_and_survives_the_cut(tokenizer: Any) -> None:
    _, collator, samples, _ = client("bert-mlm", tokenizer)
    batch = first_batch(collator, samples, eb.SplitController())
    whole = batch.unwrap()
    masked = whole["labels"] != -100
    assert masked.any() and (whole["input_ids"][masked] == SPECIAL["[MASK]"]).float().mean() > 0.5
    pieces = [mb.unwrap() for mb in batch.microbatches(3)]
    assert sum(int((p["labels"] != -100).sum()) for p in pieces) == int(masked.sum())


def test_lengths_read_from_the_pad_values_cut_as_the_mask_does(tokenizer: Any) -> None:
    collator = transformers.DataCollatorWithPadding(tokenizer)
    samples = encoded_texts(tokenizer)
    by_mask = eb.TrimPadding(collator)(samples)
    by_values = eb.TrimPadding(collator, mask=None, pad_values={"input_ids": tokenizer.pad_token_id})(samples)
    assert by_mask.padding.lengths == by_values.padding.lengths
    for a, b in zip(by_mask.microbatches(4), by_values.microbatches(4), strict=True):
        assert torch.equal(a.unwrap()["input_ids"], b.unwrap()["input_ids"])


def test_shape_buckets_round_the_trimmed_lengths_up_with_the_pad_values(tokenizer: Any) -> None:
    model, collator, samples, count_fn = client("gpt2", tokenizer)
    trim = eb.TrimPadding(
        collator,
        pad_values={"input_ids": 0, "attention_mask": 0, "labels": -100},
        shape_buckets=eb.ShapeBuckets(lengths=8),
    )
    batch = trim(samples)
    assert all(mb.unwrap()["input_ids"].shape[1] % 8 == 0 for mb in batch.microbatches(5))
    eb.ElasticStep(model, controller=eb.SplitController(split_count=5)).backward(
        batch, hf_loss(model), count_fn=count_fn
    )
    assert relative_error(model, reference_grads(model, batch.unwrap())) < RTOL


def test_workers_run_the_collator(tokenizer: Any) -> None:
    _, collator, samples, _ = client("bert-classify", tokenizer)
    loader = eb.MicrobatchingDataLoader(samples, batch_size=8, num_workers=2, collate_fn=eb.TrimPadding(collator))
    batches = list(loader)
    assert [len(b) for b in batches] == [8, 8] and all(b.padding is not None for b in batches)


def test_left_padding_is_refused_with_the_fix() -> None:
    tokenizer = make_tokenizer(padding_side="left")
    trim = eb.TrimPadding(transformers.DataCollatorWithPadding(tokenizer))
    with pytest.raises(ValueError, match=r"starts with padding \(left padding\).*tokenizer\.padding_side = 'right'"):
        trim(encoded_texts(tokenizer))
