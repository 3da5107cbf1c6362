"""``TrimPadding``: the user's padding collator kept, each microbatch cut to its own longest row.

Hugging Face's collators are tested in ``tests/test_huggingface.py``; here a small collator of
our own pads on the right and returns a mask, per-sample strings and a per-row label.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import inject_oom
from elastic_batches.variable_length.padding import Padding

LENGTHS = [3, 7, 1, 5, 2, 6]


def samples(lengths: list[int] = LENGTHS) -> list[dict[str, Any]]:
    return [{"ids": torch.arange(1, n + 1), "name": f"s{n}", "label": n % 2} for n in lengths]


def pad_collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """A collator that pads on the right (0), with a mask, a [rows, 2] feature and per-row values."""
    ids = torch.nn.utils.rnn.pad_sequence([s["ids"] for s in batch], batch_first=True)
    return {
        "ids": ids,
        "attention_mask": (ids != 0).long(),
        "targets": torch.where(ids != 0, ids, -100),
        "pair": torch.ones(len(batch), 2),
        "label": torch.tensor([s["label"] for s in batch]),
        "name": [s["name"] for s in batch],
    }


def test_lengths_come_from_the_mask_and_rows_are_sorted_longest_first() -> None:
    batch = eb.TrimPadding(pad_collate)(samples())
    assert batch.padding is not None
    assert set(batch.padding.lengths) == {"ids", "attention_mask", "targets"}  # the [rows, 7] fields only
    assert batch.padding.lengths["ids"] == (7, 6, 5, 3, 2, 1)
    assert batch.unwrap()["name"] == ["s7", "s6", "s5", "s3", "s2", "s1"]  # every field follows its row
    assert batch.unwrap()["label"].tolist() == [1, 0, 1, 1, 0, 1]


def test_each_microbatch_is_cut_to_its_own_longest_row() -> None:
    batch = eb.TrimPadding(pad_collate)(samples())
    pieces = [mb.unwrap() for mb in batch.microbatches(3)]
    assert [tuple(p["ids"].shape) for p in pieces] == [(2, 7), (2, 5), (2, 2)]
    assert [tuple(p["pair"].shape) for p in pieces] == [(2, 2)] * 3  # not a padded field: rows only
    assert pieces[2]["targets"].tolist() == [[1, 2], [1, -100]]
    assert all(p["ids"].is_contiguous() for p in pieces)


def test_sort_by_length_false_keeps_the_collators_order() -> None:
    batch = eb.TrimPadding(pad_collate, sort_by_length=False)(samples())
    assert batch.unwrap()["name"] == [f"s{n}" for n in LENGTHS]
    assert [mb.unwrap()["ids"].shape[1] for mb in batch.microbatches(3)] == [7, 5, 6]


def test_fields_names_what_is_trimmed() -> None:
    batch = eb.TrimPadding(pad_collate, fields=["ids", "attention_mask"])(samples())
    piece = list(batch.microbatches(3))[2].unwrap()
    assert piece["ids"].shape == (2, 2) and piece["targets"].shape == (2, 7)


def test_lengths_from_pad_values_without_a_mask() -> None:
    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in pad_collate(batch).items() if k != "attention_mask"}

    batch = eb.TrimPadding(collate, mask=None, pad_values={"ids": 0, "targets": -100})(samples())
    assert batch.padding is not None and batch.padding.lengths["ids"] == (7, 6, 5, 3, 2, 1)
    assert batch.padding.values == {"ids": 0, "targets": -100}


def test_an_all_padding_row_has_length_zero() -> None:
    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = pad_collate(batch)
        out["attention_mask"][-1] = 0
        return out

    batch = eb.TrimPadding(collate, sort_by_length=False)(samples([2, 3, 4]))
    assert batch.padding is not None and batch.padding.lengths["ids"] == (2, 3, 0)


def test_shape_buckets_round_up_with_the_pad_values() -> None:
    trim = eb.TrimPadding(
        pad_collate,
        pad_values={"ids": 0, "attention_mask": 0, "targets": -100},
        shape_buckets=eb.ShapeBuckets(lengths=4),
    )
    pieces = [mb.unwrap() for mb in trim(samples()).microbatches(3)]
    assert [p["ids"].shape[1] for p in pieces] == [8, 8, 4]
    assert pieces[0]["targets"][:, 7].tolist() == [-100, -100] and pieces[0]["attention_mask"][:, 7].tolist() == [0, 0]


def test_a_token_mean_loss_is_exact_through_the_loader_with_a_tokens_controller() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 8)).double()

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(mb["ids"]).flatten(0, 1), mb["targets"].flatten(), ignore_index=-100)

    loader = eb.MicrobatchingDataLoader(
        samples(),
        batch_size=6,
        collate_fn=eb.TrimPadding(pad_collate),
        controller=eb.SplitController(split_count=3, unit="tokens"),
    )
    batch = next(iter(loader))
    step = eb.ElasticStep(model, controller=loader.controller)
    with inject_oom(model, phase="forward", calls=[1]):
        step.backward(batch, loss_fn, count_fn=eb.label_count(causal=False, key="targets"))
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_fn(pad_collate(samples())).backward()
    for a, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-10, atol=1e-12)
    assert step.controller.oom_count == 1


def test_pickles_for_spawn_workers() -> None:
    trim = pickle.loads(pickle.dumps(eb.TrimPadding(pad_collate, fields=("ids",), sort_by_length=False)))
    assert trim.fields == ("ids",) and not trim.sort_by_length
    assert "TrimPadding(<function pad_collate" in repr(trim)


def test_a_field_without_pad_value_is_never_extended() -> None:
    padding = Padding(values={"ids": None}, lengths={"ids": (2, 1)}, buckets=eb.ShapeBuckets(lengths=4))
    with pytest.raises(ValueError, match=r"padded field 'ids' has no pad value to extend it to 4 positions"):
        padding.piece({"ids": torch.ones(2, 2)}, 0, 2)


# -- errors -----------------------------------------------------------------------------------------


def test_left_padding_is_refused() -> None:
    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = pad_collate(batch)
        return {k: v.flip(1) if k in ("ids", "attention_mask", "targets") else v for k, v in out.items()}

    with pytest.raises(ValueError, match=r"row 1 of 'attention_mask' starts with padding \(left padding\)"):
        eb.TrimPadding(collate, sort_by_length=False)(samples([3, 2]))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mask": "mask"}, KeyError, r"has no field 'mask' \(the mask\); its fields are \['attention_mask', 'ids'"),
        (
            {"mask": "label"},
            ValueError,
            r"field 'label' \(the mask\) must be a \[rows, length, \.\.\.\] tensor, got \(6,\)",
        ),
        ({"fields": ["nope"]}, KeyError, r"has no field 'nope' \(in fields\)"),
        (
            {"shape_buckets": eb.ShapeBuckets(lengths=4), "pad_values": {"ids": 0}},
            ValueError,
            r"fields \['attention_mask', 'targets'\] have none: add them to pad_values",
        ),
    ],
    ids=["no-mask", "mask-1d", "unknown-field", "buckets-without-values"],
)
def test_a_batch_that_cannot_be_trimmed_names_the_field(kwargs: dict[str, Any], error: type, match: str) -> None:
    trim = eb.TrimPadding(pad_collate, **kwargs)
    with pytest.raises(error, match=match):
        trim(samples())


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((None,), {}, TypeError, r"collate_fn must be callable \(the collator that pads\), got None"),
        ((pad_collate,), {"mask": None}, ValueError, r"give mask= \(the attention mask field"),
        ((pad_collate,), {"fields": []}, ValueError, r"fields must be a non-empty sequence of field names, got \[\]"),
        ((pad_collate,), {"fields": "ids"}, ValueError, r"fields must be a non-empty sequence of field names"),
        ((pad_collate,), {"pad_values": {"ids": "x"}}, TypeError, r"pad_values\['ids'\] must be a number"),
        ((pad_collate,), {"shape_buckets": 8}, TypeError, r"shape_buckets must be a elastic_batches\.ShapeBuckets"),
    ],
    ids=["collate", "nothing-to-read", "fields-empty", "fields-str", "pad-value", "buckets"],
)
def test_bad_arguments_are_named(args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        eb.TrimPadding(*args, **kwargs)


def test_pad_values_on_the_loader_and_trim_padding_are_one_too_many() -> None:
    with pytest.raises(ValueError, match=r"give one of them \(TrimPadding\(collate_fn, pad_values=\.\.\.\)"):
        eb.MicrobatchingDataLoader(
            samples(), batch_size=2, collate_fn=eb.TrimPadding(pad_collate), pad_values={"ids": 0}
        )
