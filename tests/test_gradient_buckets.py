"""``distributed.gradient_buckets``: gradients through flat buffers allocated once, whole or cut, any dense layout."""

from __future__ import annotations

import torch

from elastic_batches.distributed import gradient_buckets as buckets


def test_buckets_cut_dense_tensors_and_keep_others_whole() -> None:
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)  # dense, not contiguous
    strided = torch.randn(6, 4)[:, ::2]  # not dense: goes whole
    tensors = [torch.randn(5), conv, strided, torch.randn(0), torch.randn(7)]
    plan = buckets.FlatPlan(tensors, bucket_bytes=4 * 8, vote_numel=3)  # 8 float32 per bucket
    assert plan.splittable == [True, True, False, True, True]
    # 5 + 3 of the 48 of conv, 5 x 8 of conv, the last 5 of conv, strided whole (12 > the 3 left), 7
    assert [len(b.flat) for b in plan.buckets] == [8, 8, 8, 8, 8, 8, 5, 12, 7]
    assert plan.fused is not None and plan.vote is not None and len(plan.fused) == 8 + 3
    parts = plan.bind(tensors)
    expected = [t.clone() for t in tensors]
    for index in range(len(plan.buckets)):
        plan.fill(index, parts[index], 2.0)
        plan.drain(index, parts[index], 1.5)
    for got, want in zip(tensors, expected, strict=True):
        torch.testing.assert_close(got, 3.0 * want)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    # the whole tensors are their own parts (no view per step); the cut one is read in memory order
    assert parts[7][0] is tensors[2] and parts[8][0] is tensors[4]
    assert parts[0][0] is tensors[0] and parts[0][1].data_ptr() == conv.data_ptr()


def test_a_whole_tensor_of_any_layout_goes_through_its_bucket_unchanged() -> None:
    conv = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    transposed = torch.randn(4, 3).t()  # dense, not contiguous
    strided = torch.randn(6, 4)[:, ::2]  # not dense
    tensors = [conv, transposed, strided]
    plan = buckets.FlatPlan(tensors, bucket_bytes=buckets.DEFAULT_BUCKET_BYTES)
    (parts,) = plan.bind(tensors)
    assert all(part is tensor for part, tensor in zip(parts, tensors, strict=True))
    expected = [t.clone() for t in tensors]
    flat = plan.fill(0, parts, 2.0)
    assert flat.numel() == sum(t.numel() for t in tensors)
    plan.drain(0, parts)
    for got, want in zip(tensors, expected, strict=True):
        torch.testing.assert_close(got, 2.0 * want)
