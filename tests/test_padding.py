"""Collate-time padding, per-microbatch trimming, token-balanced pieces, shape buckets, the tokens controller."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import elastic_batches as eb
from elastic_batches.balance import split_sizes
from elastic_batches.collate import collate_padded

PAD = {"input_ids": 0, "labels": -100}


def make_samples(lengths: list[int], seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(1, 50, (length,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone(), "y": i, "text": f"sample {i} of length {length}"})
    return samples


def padded_width(mb: eb.Microbatch, key: str = "input_ids") -> int:
    return int(mb.unwrap()[key].shape[1])


# -- collate ------------------------------------------------------------------------------------


def test_collate_pads_to_the_longest_sample_sorts_longest_first_and_keeps_fields_together() -> None:
    lengths = [3, 9, 1, 5]
    batch = eb.ElasticCollate(pad_values=PAD)(make_samples(lengths))
    out = batch.unwrap()
    assert list(out) == ["input_ids", "labels", "y", "text"]
    assert out["input_ids"].shape == (4, 9)
    assert out["y"].tolist() == [1, 3, 0, 2]  # longest first
    assert out["text"] == [f"sample {i} of length {lengths[i]}" for i in (1, 3, 0, 2)]
    assert batch.padding.lengths["input_ids"] == (9, 5, 3, 1)
    for row, length in zip(out["labels"], (9, 5, 3, 1), strict=True):
        assert (row[length:] == -100).all() and (row[:length] != -100).all()


def test_sort_by_length_false_keeps_the_sampler_order() -> None:
    batch = eb.ElasticCollate(pad_values=PAD, sort_by_length=False)(make_samples([3, 9, 1, 5]))
    assert batch.unwrap()["y"].tolist() == [0, 1, 2, 3]
    assert [padded_width(mb) for mb in batch.microbatches(2)] == [9, 5]


def test_padded_fields_may_have_trailing_dimensions_and_different_lengths() -> None:
    samples = [
        {"frames": torch.ones(n, 3), "ids": torch.arange(m) + 1, "speaker": n}
        for n, m in [(4, 2), (7, 1), (2, 5), (5, 3)]
    ]
    batch = eb.ElasticCollate(pad_values={"frames": 0.0, "ids": 0})(samples)
    assert batch.padding.row_lengths() == [7, 5, 5, 4]  # longest field of each sample, sorted
    first, second = batch.microbatches(2)
    # (frames, ids) lengths in batch order: (7, 1), (2, 5), (5, 3), (4, 2)
    assert first.unwrap()["frames"].shape == (2, 7, 3) and first.unwrap()["ids"].shape == (2, 5)
    assert second.unwrap()["frames"].shape == (2, 5, 3) and second.unwrap()["ids"].shape == (2, 3)


def test_lists_of_numbers_are_padded_like_tensors() -> None:
    batch = collate_padded([{"ids": [1, 2]}, {"ids": [3]}], {"ids": 0}, collate_rest=default_collate)
    assert batch.unwrap()["ids"].tolist() == [[1, 2], [3, 0]]


def test_user_collate_fn_collates_the_other_fields() -> None:
    def collate_fn(samples: list[dict]) -> dict:
        return {"y": torch.tensor([s["y"] for s in samples]) * 10, "extra": torch.zeros(len(samples))}

    batch = eb.ElasticCollate(collate_fn, pad_values=PAD)(make_samples([2, 4]))
    assert list(batch.unwrap()) == ["input_ids", "labels", "y", "extra"]
    assert batch.unwrap()["y"].tolist() == [10, 0]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8], ids=lambda c: f"count{c}")
def test_each_microbatch_is_cut_to_its_own_longest_sample(count: int) -> None:
    lengths = [random.Random(count).randint(1, 40) for _ in range(8)]
    batch = eb.ElasticCollate(pad_values=PAD)(make_samples(lengths))
    start = 0
    for mb in batch.microbatches(count):
        rows = sorted(lengths, reverse=True)[start : start + len(mb)]
        assert padded_width(mb) == max(rows) == padded_width(mb, "labels")
        ids = mb.unwrap()["input_ids"]
        assert ids.is_contiguous()
        assert [int((row != 0).sum()) for row in ids] == rows
        start += len(mb)


def test_a_prefetched_batch_tagged_with_a_lower_count_is_re_split_tight() -> None:
    lengths = [30, 2, 17, 5, 11, 8, 25, 3]
    controller = eb.SplitController(split_count=2)
    loader = eb.MicrobatchingDataLoader(make_samples(lengths), batch_size=8, pad_values=PAD, controller=controller)
    batch = next(iter(loader))
    assert batch.split_count == 2
    # the count rose to 4 after the batch was tagged: the step re-splits it
    widths = [padded_width(mb) for mb in batch.microbatches(4)]
    assert widths == [30, 17, 8, 3]
    fresh = eb.ElasticCollate(pad_values=PAD)(make_samples(lengths))
    assert widths == [padded_width(mb) for mb in fresh.microbatches(4)]


# -- errors -------------------------------------------------------------------------------------


def test_samples_that_are_not_mappings_are_refused() -> None:
    with pytest.raises(TypeError, match=r"sample 0 is a tuple: return dicts from the dataset"):
        eb.ElasticCollate(pad_values={"ids": 0})([(torch.ones(2),), (torch.ones(3),)])


def test_a_sample_without_a_padded_field_is_named() -> None:
    with pytest.raises(KeyError, match=r"sample 1 has no field\(s\) \['labels'\]"):
        eb.ElasticCollate(pad_values=PAD)([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])


def test_mismatched_trailing_dimensions_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"padded field 'x': sample 1 has trailing shape \(2,\)"):
        eb.ElasticCollate(pad_values={"x": 0})([{"x": torch.ones(3, 4)}, {"x": torch.ones(3, 2)}])


def test_a_scalar_padded_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"padded field 'y' is a scalar"):
        eb.ElasticCollate(pad_values={"y": 0})([{"y": 1}, {"y": 2}])


def test_pad_values_must_map_to_numbers() -> None:
    with pytest.raises(TypeError, match=r"pad_values\['ids'\] must be a number"):
        eb.ElasticCollate(pad_values={"ids": "pad"})


def test_pad_values_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"pad_values must map field names to pad values"):
        eb.ElasticCollate(pad_values=["ids"])  # type: ignore[arg-type]


def test_pad_values_needs_automatic_batching() -> None:
    with pytest.raises(ValueError, match=r"pad_values needs automatic batching"):
        eb.MicrobatchingDataLoader(make_samples([2, 3]), batch_size=None, pad_values=PAD)


def test_shape_buckets_need_pad_values() -> None:
    with pytest.raises(ValueError, match=r"shape_buckets rounds padded shapes up: it needs pad_values"):
        eb.MicrobatchingDataLoader(make_samples([2, 3]), batch_size=2, shape_buckets=eb.ShapeBuckets())


def test_collate_fn_must_return_a_mapping_with_pad_values() -> None:
    with pytest.raises(TypeError, match=r"collate_fn must return a mapping of the samples' other fields, got list"):
        eb.ElasticCollate(lambda samples: [s["y"] for s in samples], pad_values=PAD)(make_samples([2, 3]))


# -- BatchLoad ----------------------------------------------------------------------------------


def test_rows_load_matches_the_balanced_row_split() -> None:
    load = eb.BatchLoad(10)
    assert load.unit == "rows"
    assert [load.sizes(k) for k in (1, 3, 4)] == [split_sizes(10, k) for k in (1, 3, 4)]
    assert [load.size_at(k) for k in (1, 3, 4, 10, 99)] == [10, 4, 3, 1, 1]
    assert [load.count_within(c) for c in (1, 3, 4, 10, 99)] == [10, 4, 3, 1, 1]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=40),
    count=st.integers(min_value=1, max_value=45),
    descending=st.booleans(),
)
def test_token_pieces_are_the_smallest_largest_piece_for_their_count(
    lengths: list[int], count: int, descending: bool
) -> None:
    if descending:
        lengths = sorted(lengths, reverse=True)
    load = eb.BatchLoad(len(lengths), lengths)
    sizes = load.sizes(count)
    assert sum(sizes) == len(lengths) and len(sizes) == min(count, len(lengths)) and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    costs = [load.cost(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    capacity = load.size_at(count)
    assert max(costs) == capacity
    assert load.count_within(capacity) <= count
    if capacity > max(load.lengths):  # one token less would need more pieces: the bound is tight
        assert load.count_within(capacity - 1) > count
    rows_bounds = [0, *itertools.accumulate(split_sizes(len(lengths), min(count, len(lengths))))]
    assert capacity <= max(load.cost(a, b) for a, b in zip(rows_bounds, rows_bounds[1:], strict=False))


def test_token_pieces_carry_more_similar_token_counts_than_row_pieces() -> None:
    rng = random.Random(0)
    lengths = sorted((max(1, int(rng.lognormvariate(math.log(64), 0.8))) for _ in range(64)), reverse=True)
    load = eb.BatchLoad(64, lengths)

    def token_spread(sizes: list[int]) -> float:
        tokens, start = [], 0
        for size in sizes:
            tokens.append(sum(lengths[start : start + size]))
            start += size
        return max(tokens) / min(tokens)

    for count in (2, 4, 8, 16):
        by_tokens, by_rows = token_spread(load.sizes(count)), token_spread(split_sizes(64, count))
        assert by_tokens < 2.0 and 2 * by_tokens < by_rows, (count, by_tokens, by_rows)


def test_batch_load_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"2 lengths given for 3 rows"):
        eb.BatchLoad(3, [1, 2])


def test_a_tokens_load_needs_a_padded_batch() -> None:
    with pytest.raises(ValueError, match=r"give the MicrobatchingDataLoader pad_values"):
        eb.ElasticBatch.wrap(torch.zeros(4, 2)).load("tokens")


# -- tokens controller --------------------------------------------------------------------------


def test_tokens_controller_gives_longer_batches_more_microbatches_before_any_oom() -> None:
    controller = eb.SplitController(unit="tokens")
    short = eb.BatchLoad(32, [16] * 32)
    controller.record_oom(size=512, load=short)  # 32 x 16 did not fit
    assert controller.plan(short) == 2
    controller.record_success(size=256, load=short)
    longer = eb.BatchLoad(32, [64] * 32)
    assert controller.count_for(longer) == 8  # 4x the tokens: 4x the microbatches, no OOM needed
    assert longer.size_at(controller.count_for(longer)) <= 256


def test_a_rows_controller_does_not_see_the_length() -> None:
    controller = eb.SplitController()
    controller.record_oom(size=32, load=32)
    controller.record_success(size=16, load=32)
    assert controller.count_for(32) == 2  # whatever the sequences' length


def test_tokens_controller_raises_at_one_sample_per_microbatch() -> None:
    controller = eb.SplitController(unit="tokens")
    load = eb.BatchLoad(4, [100, 90, 10, 10])
    with pytest.raises(eb.ElasticOOMError, match=r"even at microbatch size 100 tokens \(3 microbatches\)"):
        controller.record_oom(size=100, load=load)


def test_tokens_controller_wants_batch_loads() -> None:
    with pytest.raises(TypeError, match=r"pass batch.load\('tokens'\)"):
        eb.SplitController(unit="tokens").plan(64)


def test_controller_refuses_a_load_in_another_unit() -> None:
    with pytest.raises(ValueError, match=r"SplitController\(unit='rows'\) got a BatchLoad in tokens"):
        eb.SplitController().plan(eb.BatchLoad(2, [3, 4]))


def test_controller_unit_is_checked() -> None:
    with pytest.raises(ValueError, match=r"unit must be 'rows' or 'tokens', got 'bytes'"):
        eb.SplitController(unit="bytes")


def test_tokens_controller_state_round_trip() -> None:
    a = eb.SplitController(unit="tokens", grow_after=3)
    load = eb.BatchLoad(8, [40, 30, 20, 20, 10, 10, 5, 1])
    a.record_oom(size=load.size_at(1), load=load, discarded=1)
    a.record_success(size=load.size_at(a.plan(load)), load=load)
    b = eb.SplitController(unit="tokens", grow_after=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.split_count, b.microbatch_size, b.plan(load)) == (a.split_count, a.microbatch_size, a.plan(load))


def test_a_tokens_state_does_not_load_into_a_rows_controller() -> None:
    state = eb.SplitController(unit="tokens").state_dict()
    with pytest.raises(ValueError, match=r"learned with unit='tokens', this controller has unit='rows'"):
        eb.SplitController().load_state_dict(state)


# -- loader -------------------------------------------------------------------------------------


def test_loader_keeps_its_padding_arguments_as_attributes_and_rebuilds_from_them() -> None:
    buckets = eb.ShapeBuckets(lengths=8)
    loader = eb.MicrobatchingDataLoader(
        make_samples([5, 3, 12, 7]), batch_size=4, pad_values=PAD, sort_by_length=False, shape_buckets=buckets
    )
    assert (loader.pad_values, loader.sort_by_length, loader.shape_buckets) == (PAD, False, buckets)
    # Lightning re-instantiates a DataLoader subclass from its same-named attributes
    rebuilt = type(loader)(
        dataset=loader.dataset,
        batch_size=loader.batch_size,
        collate_fn=loader.collate_fn,
        controller=loader.controller,
        pad_values=loader.pad_values,
        sort_by_length=loader.sort_by_length,
        shape_buckets=loader.shape_buckets,
    )
    wrapped = eb.MicrobatchingDataLoader(loader)
    for other in (rebuilt, wrapped):
        assert (other.pad_values, other.sort_by_length, other.shape_buckets) == (PAD, False, buckets)
        assert [padded_width(mb) for mb in next(iter(other)).microbatches(2)] == [8, 16]


def test_loader_tags_with_the_tokens_controller() -> None:
    controller = eb.SplitController(unit="tokens")
    controller.record_oom(size=128, load=eb.BatchLoad(8, [16] * 8))
    controller.record_success(size=64, load=eb.BatchLoad(8, [16] * 8))
    loader = eb.MicrobatchingDataLoader(make_samples([16] * 8), batch_size=8, pad_values=PAD, controller=controller)
    batch = next(iter(loader))
    assert batch.split_count == 2
    assert [len(mb) for mb in batch.microbatches(balance="tokens")] == [4, 4]


# -- shape buckets ------------------------------------------------------------------------------


def test_length_buckets_pad_with_the_pad_value() -> None:
    batch = eb.ElasticCollate(pad_values=PAD, shape_buckets=eb.ShapeBuckets(lengths="pow2"))(make_samples([5, 3]))
    mb = next(batch.microbatches(1)).unwrap()
    assert mb["input_ids"].shape == (2, 8)
    assert (mb["labels"][0, 5:] == -100).all() and (mb["labels"][1, 3:] == -100).all()


def test_row_buckets_add_rows_of_pad_values() -> None:
    samples = [{k: v for k, v in s.items() if k in PAD} for s in make_samples([5, 3, 2])]
    batch = eb.ElasticCollate(pad_values=PAD, shape_buckets=eb.ShapeBuckets(lengths=4, rows=4))(samples)
    mb = next(batch.microbatches(1))
    assert mb.unwrap()["input_ids"].shape == (4, 8)
    assert (mb.unwrap()["labels"][3] == -100).all() and (mb.unwrap()["input_ids"][3] == 0).all()
    assert mb.weight == 1.0


def test_row_buckets_need_a_pad_value_for_every_field() -> None:
    batch = eb.ElasticCollate(pad_values=PAD, shape_buckets=eb.ShapeBuckets(rows=4))(make_samples([5, 3, 2]))
    with pytest.raises(ValueError, match=r"fields \['text', 'y'\] have no pad value"):
        next(batch.microbatches(1))


@pytest.mark.parametrize("bad", [0, -2, 1.5, "pow3", True], ids=repr)
def test_shape_buckets_check_their_rounding(bad: object) -> None:
    with pytest.raises(ValueError, match=r"ShapeBuckets: lengths must be an int >= 1 \(a multiple\), 'pow2' or None"):
        eb.ShapeBuckets(lengths=bad)  # type: ignore[arg-type]


def test_row_buckets_need_count_fn_in_the_step() -> None:
    samples = [{k: v for k, v in s.items() if k in PAD} for s in make_samples([5, 3, 2])]
    batch = eb.ElasticCollate(pad_values=PAD, shape_buckets=eb.ShapeBuckets(rows=4))(samples)
    model = torch.nn.Embedding(50, 2)
    step = eb.ElasticStep(model)
    with pytest.raises(ValueError, match=r"ShapeBuckets\(rows=4\) pads microbatches with rows of pad values.*count_fn"):
        step.backward(batch, lambda mb: model(mb["input_ids"]).mean())
