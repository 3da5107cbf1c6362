"""``ElasticStep.backward``: the same update as one full-batch step, whatever splits and OOMs happen.

Tolerances: float32 gradients must equal the full-batch reference within 1e-6 of the largest
entry of the reference gradient (``_assert_grads``); only summation order differs. With bf16
autocast the reference is computed under the same autocast and the tolerance is 2e-2 (bf16 keeps
8 bits of mantissa).
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import elastic_batches as eb
from elastic_batches.batch import split_sizes
from elastic_batches.testing import MemoryBudget, inject_oom, inject_oom_in_cut, inject_oom_in_op

Batch = tuple[torch.Tensor, torch.Tensor]


def _model(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def _batch(rows: int = 12, seed: int = 1) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator)


def _mse(model: nn.Module) -> Callable[[Batch], torch.Tensor]:
    def loss_fn(mb: Batch) -> torch.Tensor:
        return (model(mb[0]) - mb[1]).pow(2).mean()

    return loss_fn


def _reference(model: nn.Module, *batches: Batch) -> list[torch.Tensor]:
    """Sum over ``batches`` of the gradient of each full-batch mean loss, leaving ``.grad`` alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for batch in batches:
        grads = torch.autograd.grad(_mse(model)(batch), params)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return total


def _assert_grads(model: nn.Module, reference: list[torch.Tensor], rel: float = 1e-6) -> None:
    """Every entry within ``rel`` of the largest entry of the whole reference gradient (one vector).

    Per tensor would be ill-conditioned: a bias gradient that is a sum of cancelling terms can be
    100x smaller than its terms, whose float32 rounding then dominates.
    """
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    scale = max(ref.abs().max().item() for ref in reference)
    for (name, p), ref in zip(trained, reference, strict=True):
        assert p.grad is not None, name
        error = (p.grad - ref).abs().max().item()
        assert error <= rel * scale, f"{name}: max error {error:.3g} > {rel} x {scale:.3g}"


class Sizes:
    """A loss_fn wrapper that records the rows of every microbatch it sees."""

    def __init__(self, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        self.loss_fn, self.rows = loss_fn, []

    def __call__(self, mb: Any) -> torch.Tensor:
        self.rows.append(len(mb[0]))
        return self.loss_fn(mb)


# ---------------------------------------------------------------------------------------------
# Same update


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_step_trains_its_own_copy_of_the_model(how: str) -> None:
    """The engine holds its step weakly (no cycle); copied with it, it follows the copy, not the original."""
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    copied_model, copied = (
        copy.deepcopy((model, step)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, step)))
    )
    assert copied.engine.step is copied and copied.model is copied_model
    batch = _batch()
    copied.backward(batch, _mse(copied_model))
    assert all(p.grad is None for p in model.parameters())
    _assert_grads(copied_model, _reference(copied_model, batch))


def test_an_engine_whose_step_is_gone_says_so() -> None:
    engine = eb.ElasticStep(_model()).engine
    with pytest.raises(RuntimeError, match="its ElasticStep is gone"):
        _ = engine.controller


@pytest.mark.parametrize("count", range(1, 8), ids=[f"split-{k}" for k in range(1, 8)])
def test_grads_equal_the_full_batch_gradient_for_any_split(count: int) -> None:
    model, batch = _model(), _batch(10)
    reference = _reference(model, batch)
    full_loss = _mse(model)(batch).detach()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=count))
    loss_fn = Sizes(_mse(model))
    loss = step.backward(batch, loss_fn)
    assert loss_fn.rows == split_sizes(10, count)  # 10 in 3: 4, 3, 3
    _assert_grads(model, reference)
    assert not loss.requires_grad and math.isclose(loss.item(), full_loss.item(), rel_tol=1e-6)


@pytest.mark.parametrize("phase", ["forward", "backward"], ids=["forward", "backward"])
@pytest.mark.parametrize("call", [0, 1, 2], ids=["first-microbatch", "middle-microbatch", "last-microbatch"])
def test_oom_at_any_microbatch_retries_to_the_same_update(phase: str, call: int) -> None:
    model, batch = _model(), _batch(12)
    reference = _reference(model, batch)
    controller = eb.SplitController(split_count=3)
    step = eb.ElasticStep(model, controller=controller)
    loss_fn = Sizes(_mse(model))
    # backward: strike the first layer, so that the last one already received its share of this microbatch
    target = model if phase == "forward" else model[0]
    with inject_oom(target, phase=phase, calls=call) as oom:
        loss = step.backward(batch, loss_fn)
    assert oom.fired == 1
    assert loss_fn.rows == [4] * (call + 1) + [2] * 6  # the failed attempt, then 6 microbatches of 2
    _assert_grads(model, reference)
    assert math.isclose(loss.item(), _mse(model)(batch).item(), rel_tol=1e-6)
    assert (controller.oom_count, controller.retry_count, controller.discarded_microbatches) == (1, 1, call + 1)
    assert controller.split_count == 6


def test_repeated_ooms_in_one_step_still_give_the_same_update() -> None:
    model, batch = _model(), _batch(12)
    reference = _reference(model, batch)
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller)
    with inject_oom(model[0], phase="backward", calls=[0, 2, 4]):  # attempts of 1, 2 (fails at 2nd), 3 ...
        step.backward(batch, _mse(model))
    assert controller.oom_count == 3
    _assert_grads(model, reference)


@pytest.mark.parametrize("oom_in_second", [False, True], ids=["no-oom", "oom-in-second-batch"])
def test_existing_grads_are_kept_and_not_double_counted(oom_in_second: bool) -> None:
    model = _model()
    first, second = _batch(10, seed=1), _batch(10, seed=2)
    reference = _reference(model, first, second)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    step.backward(first, _mse(model))
    held = [p.grad for p in model.parameters()]
    oom = inject_oom(model[0], phase="backward", calls=1)
    if not oom_in_second:
        oom.remove()
    with oom:
        step.backward(second, _mse(model))
    _assert_grads(model, reference)
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))  # accumulated in place


def test_plain_loop_accumulation_before_the_step_is_kept() -> None:
    model, batch, other = _model(), _batch(8), _batch(8, seed=5)
    reference = _reference(model, other, batch)
    _mse(model)(other).backward()  # the user's own backward before the call
    with inject_oom(model, phase="forward", calls=0):
        eb.ElasticStep(model).backward(batch, _mse(model))
    _assert_grads(model, reference)


def test_frozen_parameters_are_left_alone() -> None:
    model, batch = _model(), _batch(8)
    model[0].weight.requires_grad_(False)
    reference = _reference(model, batch)
    eb.ElasticStep(model, controller=eb.SplitController(split_count=3)).backward(batch, _mse(model))
    assert model[0].weight.grad is None
    _assert_grads(model, reference)


# ---------------------------------------------------------------------------------------------
# Errors other than OOM pass through and change nothing


class Boom(Exception):
    pass


def _boom_in_backward(module: nn.Module, call: int, raised: list[BaseException]) -> Callable[[], None]:
    """Raise ``Boom`` in the backward of forward call ``call`` of ``module``; returns the hook remover."""
    calls = [0]

    def forward_hook(mod: nn.Module, args: Any, output: torch.Tensor) -> None:
        index = calls[0]
        calls[0] += 1
        if index == call:

            def grad_hook(grad: torch.Tensor) -> None:
                raised.append(Boom(f"backward of call {index}"))
                raise raised[-1]

            output.register_hook(grad_hook)

    return module.register_forward_hook(forward_hook).remove


@pytest.mark.parametrize("phase", ["forward", "backward"], ids=["in-loss-fn", "in-backward"])
@pytest.mark.parametrize("call", [0, 1, 2], ids=["first-microbatch", "middle-microbatch", "last-microbatch"])
@pytest.mark.parametrize("learned", [False, True], ids=["fresh-controller", "learned-controller"])
def test_other_errors_propagate_unchanged_and_leave_grads_and_controller_as_they_were(
    phase: str, call: int, learned: bool
) -> None:
    model = _model()
    controller = eb.SplitController(split_count=3)
    step = eb.ElasticStep(model, controller=controller)
    if learned:
        with inject_oom(model, phase="forward", calls=0):
            step.backward(_batch(12, seed=3), _mse(model))  # learns: 6 microbatches
        controller.record_success(2, 12)
        calls_per_attempt = 6
    else:
        calls_per_attempt = 3
    model[2].bias.grad = None  # a parameter without grad must stay without
    before = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    held = {name: p.grad for name, p in model.named_parameters()}
    state = controller.state_dict()
    split_count = controller.split_count

    raised: list[BaseException] = []
    seen = [0]

    def loss_fn(mb: Batch) -> torch.Tensor:
        if phase == "forward" and seen[0] == call:
            raised.append(Boom(f"microbatch {call}"))
            raise raised[-1]
        seen[0] += 1
        return _mse(model)(mb)

    remove = _boom_in_backward(model[0], call, raised) if phase == "backward" else lambda: None
    try:
        with pytest.raises(Boom) as excinfo:
            step.backward(_batch(12), loss_fn)
    finally:
        remove()
    assert call < calls_per_attempt and len(raised) == 1 and excinfo.value is raised[0]  # the same object
    for name, p in model.named_parameters():
        if before[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad is held[name] and torch.equal(p.grad, before[name]), name  # bit-identical
    assert controller.split_count == split_count
    assert controller.state_dict() == state


def test_error_on_the_retry_after_an_oom_restores_the_grads() -> None:
    model = _model()
    step = eb.ElasticStep(model)
    _mse(model)(_batch(6, seed=9)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    attempts = [0]

    def loss_fn(mb: Batch) -> torch.Tensor:
        attempts[0] += 1
        if attempts[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        raise Boom("on the retry")

    with pytest.raises(Boom, match="on the retry"):
        step.backward(_batch(12), loss_fn)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_oom_at_microbatch_size_one_raises_elastic_oom_error_and_restores_grads() -> None:
    model = _model()
    step = eb.ElasticStep(model)
    _mse(model)(_batch(6, seed=9)).backward()
    before = [p.grad.clone() for p in model.parameters()]

    def loss_fn(mb: Batch) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    with pytest.raises(
        eb.ElasticOOMError,
        match=r"out of memory on a batch of 12 rows even at microbatch size 1 \(12 microbatches\); "
        r"microbatch sizes tried on this batch: 12, 6, 3, 2, 1\.",
    ) as excinfo:
        step.backward(_batch(12), loss_fn)
    assert isinstance(excinfo.value, torch.OutOfMemoryError)
    assert isinstance(excinfo.value.__cause__, torch.OutOfMemoryError)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("as_probe", [False, True], ids=["budget-entered", "budget-as-the-steps-probe"])
def test_oom_at_one_row_names_the_memory_in_use_before_the_step(as_probe: bool) -> None:
    # the model is made inside the budget, whose limit is then set below its parameters and their gradients
    budget = MemoryBudget(None)
    with budget:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # 67588 bytes: 66.00 KiB
    assert budget.live_bytes == params
    budget.limit_bytes = params * 3 // 2  # 99.01 KiB: the first layer's gradient (64.00 KiB) never fits
    step = eb.ElasticStep(model, memory=budget if as_probe else None)
    batch = torch.randn(8, 64)  # made outside: not counted
    with (
        pytest.raises(
            eb.ElasticOOMError,
            match=r"even at microbatch size 1 \(8 microbatches\).*lower the batch size or free memory\. MemoryBudget: "
            r"66\.00 KiB of 99\.01 KiB were in use before the step began \(67%: the model, its gradients and optimizer "
            r"state.*\), leaving 33\.00 KiB; the microbatch of 1 row held \d+\.\d+ KiB more when an allocation of "
            r"64\.00 KiB failed: it needs at least \d+\.\d+ KiB, \d+\.\d+ KiB more than was left\. No split makes",
        ),
        budget,
    ):
        step.backward(batch, lambda mb: model(mb).pow(2).mean())


# ---------------------------------------------------------------------------------------------
# Simulated device memory


def _peak(model: nn.Module, batch: Batch, count: int) -> int:
    budget = MemoryBudget(None)
    with budget:
        eb.ElasticStep(model, controller=eb.SplitController(split_count=count)).backward(batch, _mse(model))
    model.zero_grad(set_to_none=True)
    return budget.peak_bytes


def test_memory_budget_run_settles_and_matches_the_reference() -> None:
    model, batches = _model(width=256), [_batch(64, seed=s) for s in range(6)]
    limit = (_peak(model, batches[0], 3) + _peak(model, batches[0], 4)) // 2
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller, memory=None)  # the OOM-driven search alone
    budget = MemoryBudget(limit)
    ooms = []
    for batch in batches:
        reference = _reference(model, batch)
        with budget:
            step.backward(batch, _mse(model))
        _assert_grads(model, reference)
        model.zero_grad(set_to_none=True)
        ooms.append(controller.oom_count)
    assert controller.split_count == 4  # 3 microbatches of 22 do not fit, 4 of 16 do
    assert ooms[0] >= 1 and len(set(ooms[-3:])) == 1  # settled: no OOM in the last steps
    assert budget.oom_count == controller.oom_count <= math.ceil(math.log2(64)) + 4
    assert budget.live_bytes == 0


# ---------------------------------------------------------------------------------------------
# Tag and controller


@pytest.mark.parametrize(
    ("tag", "controller_count", "expected"),
    [(5, 1, 5), (2, 4, 4), (4, 4, 4)],
    ids=["tag-larger", "controller-larger", "equal"],
)
def test_step_uses_the_larger_of_tag_and_controller(tag: int, controller_count: int, expected: int) -> None:
    model = _model()
    batch = eb.ElasticBatch.wrap(_batch(10), split_count=tag)
    loss_fn = Sizes(_mse(model))
    eb.ElasticStep(model, controller=eb.SplitController(split_count=controller_count)).backward(batch, loss_fn)
    assert loss_fn.rows == split_sizes(10, expected)


def test_a_tag_equal_to_the_settled_count_does_not_block_the_controllers_probe() -> None:
    model = _model()
    controller = eb.SplitController()
    controller.record_oom(12, 12)
    controller.record_oom(6, 12)  # 4 microbatches of 3
    controller.record_success(3, 12)
    batch = eb.ElasticBatch.wrap(_batch(12), split_count=controller.count_for(12))  # as the loader tags it
    loss_fn = Sizes(_mse(model))
    eb.ElasticStep(model, controller=controller).backward(batch, loss_fn)
    assert loss_fn.rows == [4, 4, 4]  # the probe between 3 (fits) and 6 (failed)


def test_search_through_the_step_with_a_size_oracle_reaches_90_percent() -> None:
    model, batch = _model(), _batch(100)
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller)

    def loss_fn(mb: Batch) -> torch.Tensor:
        if len(mb[0]) > 49:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: more than 49 rows)")
        return _mse(model)(mb)

    for _ in range(12):
        tagged = eb.ElasticBatch.wrap(batch, split_count=controller.count_for(100))
        step.backward(tagged, loss_fn)
        model.zero_grad(set_to_none=True)
    ooms = controller.oom_count
    assert ooms <= math.ceil(math.log2(100)) + 4
    assert math.ceil(100 / controller.split_count) >= 0.9 * 34  # 3 microbatches of 34: no count gives 35..49
    step.backward(batch, loss_fn)
    assert controller.oom_count == ooms


def test_grow_after_probe_that_fails_loses_no_batch() -> None:
    model = _model()
    controller = eb.SplitController(split_count=3, grow_after=1)
    step = eb.ElasticStep(model, controller=controller)
    loss_fn = Sizes(lambda mb: _oracle_loss(model, mb, limit=4))
    for seed in range(4):
        batch = _batch(12, seed=seed)
        reference = _reference(model, batch)
        step.backward(batch, loss_fn)
        _assert_grads(model, reference)
        model.zero_grad(set_to_none=True)
    assert controller.oom_count >= 1  # a growth probe (2 microbatches of 6) failed and the batch was retried
    assert controller.split_count == 3


def _oracle_loss(model: nn.Module, mb: Batch, limit: int) -> torch.Tensor:
    if len(mb[0]) > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: more than {limit} rows)")
    return _mse(model)(mb)


# ---------------------------------------------------------------------------------------------
# AMP


def test_grad_scaler_scales_every_microbatch_backward() -> None:
    model, batch = _model(), _batch(10)
    reference = _reference(model, batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3), grad_scaler=scaler)
    with inject_oom(model[0], phase="backward", calls=1):
        loss = step.backward(batch, _mse(model))
    _assert_grads(model, [r * 2.0**10 for r in reference])
    assert math.isclose(loss.item(), _mse(model)(batch).item(), rel_tol=1e-6)  # the loss is not scaled

    expected = [p.detach() - 0.1 * r for p, r in zip(model.parameters(), reference, strict=True)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.step(optimizer)
    scaler.update()
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_bf16_autocast_in_loss_fn_with_grad_scaler() -> None:
    model, batch = _model(), _batch(10)

    def loss_fn(mb: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(mb[0])
        return (out.float() - mb[1]).pow(2).mean()

    params = list(model.parameters())
    reference = torch.autograd.grad(loss_fn(batch), params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3), grad_scaler=scaler)
    step.backward(batch, loss_fn)
    assert all(p.grad.dtype == torch.float32 for p in params)
    _assert_grads(model, [r * 2.0**8 for r in reference], rel=2e-2)


# ---------------------------------------------------------------------------------------------
# count_fn: losses that are means over counted items


def test_count_fn_gives_the_exact_token_mean_gradient() -> None:
    torch.manual_seed(3)
    model = _model()
    x, y = torch.randn(10, 5, 4), torch.randn(10, 5, 1)
    mask = torch.zeros(10, 5, dtype=torch.bool)
    for i, n in enumerate([5, 1, 0, 3, 5, 2, 0, 4, 1, 5]):  # tokens per sample, uneven; two samples without any
        mask[i, :n] = True
    batch = {"x": x, "y": y, "mask": mask}

    def loss_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        err = (model(mb["x"]) - mb["y"]).pow(2).squeeze(-1)
        return err[mb["mask"]].sum() / mb["mask"].sum()  # mean over this microbatch's tokens

    reference = torch.autograd.grad(loss_fn(batch), list(model.parameters()))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=5))  # one microbatch holds no token
    loss = step.backward(batch, loss_fn, count_fn=lambda mb: mb["mask"].sum())
    _assert_grads(model, list(reference))
    assert math.isclose(loss.item(), loss_fn(batch).item(), rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------
# Structures and arguments


def test_loss_fn_receives_the_users_structure() -> None:
    model = _model()
    seen = []

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        seen.append((type(mb), mb["names"], mb["lr"]))
        return (model(mb["x"]) - mb["y"]).pow(2).mean()

    batch = {"x": _batch(4)[0], "y": _batch(4)[1], "names": list("abcd"), "lr": 0.5}
    eb.ElasticStep(model, controller=eb.SplitController(split_count=2)).backward(batch, loss_fn)
    assert seen == [(dict, ["a", "b"], 0.5), (dict, ["c", "d"], 0.5)]


def test_empty_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"ElasticStep\.backward: the batch is empty \(0 rows\)"):
        eb.ElasticStep(_model()).backward(torch.zeros(0, 4), lambda mb: mb.sum())


def test_non_scalar_loss_is_a_clear_error() -> None:
    model = _model()
    with pytest.raises(
        ValueError, match=r"loss_fn must return a scalar loss tensor \(a mean over the microbatch\), got \(4, 1\)"
    ):
        eb.ElasticStep(model).backward(_batch(4), lambda mb: model(mb[0]))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("model",), {}, TypeError, r"ElasticStep expects an nn\.Module as model, got str"),
        ((None,), {"controller": 3}, TypeError, r"controller must be an elastic_batches\.SplitController, got 3"),
        (
            (None,),
            {"grad_scaler": torch.amp.GradScaler("cpu"), "backward_fn": lambda loss: None},
            ValueError,
            r"pass grad_scaler or backward_fn, not both",
        ),
    ],
    ids=["model", "controller", "scaler-and-backward-fn"],
)
def test_constructor_rejects_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, message: str
) -> None:
    args = tuple(_model() if a is None else a for a in args)
    with pytest.raises(error, match=message):
        eb.ElasticStep(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Everything between the start of an attempt and the vote belongs to the attempt


def _padded(rows: int = 12, seed: int = 4) -> eb.ElasticBatch:
    """A padded batch (a loader with ``pad_values``): ``x``, ``y`` and ragged token ids."""
    generator = torch.Generator().manual_seed(seed)
    samples = [
        {
            "x": torch.randn(4, generator=generator),
            "y": torch.randn(1, generator=generator),
            "ids": torch.randint(1, 9, (1 + i % 5,), generator=generator),
        }
        for i in range(rows)
    ]
    return eb.ElasticCollate(pad_values={"ids": 0})(samples)


def _padded_mse(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def loss_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (model(mb["x"]) - mb["y"]).pow(2).mean() + 0.0 * mb["ids"].sum()

    return loss_fn


def _padded_reference(model: nn.Module, batch: eb.ElasticBatch) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(_padded_mse(model)(batch.unwrap()), params))


@pytest.mark.parametrize("call", [0, 1, 2], ids=["first-cut", "middle-cut", "last-cut"])
def test_an_oom_in_the_cut_of_a_padded_microbatch_is_retried(call: int) -> None:
    model, batch = _model(), _padded()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    with inject_oom_in_cut(calls=call) as oom:
        step.backward(batch, _padded_mse(model))
    assert oom.fired == 1 and step.controller.oom_count == 1 and step.controller.split_count == 6
    assert step.controller.discarded_microbatches == call  # the microbatches before the cut ran, then were dropped
    _assert_grads(model, _padded_reference(model, batch))


def test_an_oom_raised_by_padding_itself_is_retried() -> None:
    """The trimmed copy padding makes (``contiguous``): an OOM raised there by hand, not by a helper."""
    model, batch = _model(), _padded()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    copies = [0]
    original = torch.Tensor.contiguous

    def contiguous(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies[0] += 1
        if copies[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)")
        return original(self, *args, **kwargs)

    torch.Tensor.contiguous = contiguous  # type: ignore[method-assign]
    try:
        step.backward(batch, _padded_mse(model))
    finally:
        torch.Tensor.contiguous = original  # type: ignore[method-assign]
    assert step.controller.oom_count == 1
    _assert_grads(model, _padded_reference(model, batch))


@pytest.mark.parametrize("call", [0, 2], ids=["first-count", "last-count"])
def test_an_oom_in_count_fn_is_retried(call: int) -> None:
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    calls = [0]

    def count_fn(mb: Batch) -> int:
        calls[0] += 1
        if calls[0] == call + 1:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test's count_fn)")
        return len(mb[0])

    step.backward(_batch(12), _mse(model), count_fn=count_fn)
    assert step.controller.oom_count == 1 and step.controller.split_count == 6
    assert step.controller.discarded_microbatches == 0  # count_fn runs before the first forward
    _assert_grads(model, _reference(model, _batch(12)))


def test_an_oom_in_the_sum_of_the_losses_is_retried() -> None:
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    with inject_oom_in_op(torch.ops.aten.stack, calls=0) as oom:
        loss = step.backward(_batch(12), _mse(model))
    assert oom.fired == 1 and step.controller.oom_count == 1 and step.controller.discarded_microbatches == 3
    torch.testing.assert_close(loss, _mse(model)(_batch(12)).detach())
    _assert_grads(model, _reference(model, _batch(12)))


def test_evaluate_retries_an_oom_in_the_cut_and_in_combine() -> None:
    model, batch = _model(), _padded()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    combined = [0]

    def combine(outputs: list[torch.Tensor], microbatches: list[eb.Microbatch]) -> torch.Tensor:
        combined[0] += 1
        if combined[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test's combine)")
        assert [len(mb) for mb in microbatches] == [len(o) for o in outputs]
        return torch.cat(outputs)

    with torch.no_grad(), inject_oom_in_cut(calls=1):
        out = step.evaluate(batch, lambda mb: model(mb["x"]), combine=combine)
    assert step.controller.oom_count == 2 and combined[0] == 2  # the cut, then combine: 3 -> 6 -> 12
    torch.testing.assert_close(out, model(batch.unwrap()["x"]).detach())


# ---------------------------------------------------------------------------------------------
# Nothing of a failed attempt survives: buffers, random state, gradients of batch tensors


class _Counter(nn.Module):
    """Buffers a forward changes: a counter in place, a cache by reassignment, a constant left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("last", torch.zeros(4))
        self.register_buffer("constant", torch.arange(1000.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = x.detach().mean(0)
        return x


def _buffered_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Counter(), nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1))


def _state_after(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], torch.Tensor]:
    return (
        {name: b.clone() for name, b in model.named_buffers()},
        [p.grad.clone() for p in model.parameters()],
        torch.get_rng_state(),
    )


@pytest.mark.parametrize("call", [0, 1, 2], ids=["first-microbatch", "middle-microbatch", "last-microbatch"])
def test_a_retried_step_equals_the_same_step_run_at_its_split_directly(call: int) -> None:
    """Buffers (BatchNorm's running stats, an in-place counter, a reassigned cache), dropout draws, gradients."""
    direct = _buffered_model()
    torch.manual_seed(7)
    eb.ElasticStep(direct, controller=eb.SplitController(split_count=6)).backward(_batch(12), _mse(direct))
    expected_buffers, expected_grads, expected_rng = _state_after(direct)

    model = _buffered_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm warning
        with inject_oom(model[5], phase="backward", calls=call):
            step.backward(_batch(12), _mse(model))
    assert step.controller.split_count == 6
    buffers, grads, rng = _state_after(model)
    assert buffers.keys() == expected_buffers.keys()
    for name, value in buffers.items():
        assert torch.equal(value, expected_buffers[name]), name
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, want)  # same microbatches, same dropout masks, same order: bit-identical
    assert torch.equal(rng, expected_rng)


def test_a_step_that_raises_leaves_buffers_and_random_state_as_they_were() -> None:
    model = _buffered_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    torch.manual_seed(3)
    before = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    cached = model[0].last
    runs = [0]

    def loss_fn(mb: Batch) -> torch.Tensor:
        runs[0] += 1
        if runs[0] == 3:
            raise Boom("in the last microbatch")
        return _mse(model)(mb)

    with pytest.raises(Boom), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step.backward(_batch(12), loss_fn)
    assert model[0].last is cached
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name
    assert torch.equal(torch.get_rng_state(), rng)


class _Copies(TorchDispatchMode):
    """Records the element count of every tensor copied into (``copy_``, ``_foreach_copy_``, ``_to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in (torch.ops.aten.copy_, torch.ops.aten._to_copy, torch.ops.aten.clone):
            self.numels.append(args[0].numel())
        elif packet is torch.ops.aten._foreach_copy_:
            self.numels.extend(t.numel() for t in args[0])
        return func(*args, **(kwargs or {}))


def test_a_constant_buffer_is_copied_at_the_first_step_only() -> None:
    model = _buffered_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _Copies() as first:
            step.backward(_batch(12), _mse(model))  # nothing is known yet: every buffer is copied
        with _Copies() as later:
            step.backward(_batch(12, seed=2), _mse(model))
    assert 1000 in first.numels
    assert 1000 not in later.numels
    # the counter (it changed in place) and BatchNorm's running mean, running var and num_batches_tracked
    assert sorted(later.numels) == [1, 1, 8, 8]


@pytest.mark.parametrize("count", [1, 3], ids=["whole", "split-3"])
@pytest.mark.parametrize("oom", [False, True], ids=["no-oom", "oom"])
def test_the_same_leaf_twice_in_a_batch_gets_the_gradient_plain_pytorch_gives(count: int, oom: bool) -> None:
    x = torch.randn(12, 4, requires_grad=True)
    x.grad = torch.full_like(x, 0.5)  # an earlier gradient
    weight = torch.randn(4, 1)

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = mb
        return ((a @ weight) * b.sum(1, keepdim=True)).mean()

    expected = 0.5 + torch.autograd.grad(loss_fn((x, x)), x)[0]
    step = eb.ElasticStep(nn.Linear(1, 1), controller=eb.SplitController(split_count=count))
    with inject_oom_in_op(torch.ops.aten.mm, calls=[0] if oom else [10**6]):
        step.backward((x, x), loss_fn)
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-7)


def test_a_zero_dim_batch_tensor_gets_no_gradient_from_a_failed_attempt() -> None:
    x, y = _batch(12)
    scale = torch.tensor(2.0, requires_grad=True)  # broadcast to every microbatch
    model = _model()

    def loss_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (model(mb["x"]) * mb["scale"] - mb["y"]).pow(2).mean()

    expected = torch.autograd.grad(loss_fn({"x": x, "y": y, "scale": scale}), scale)[0]
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    with inject_oom(model, phase="backward", calls=2):
        step.backward({"x": x, "y": y, "scale": scale}, loss_fn)
    assert step.controller.oom_count == 1
    torch.testing.assert_close(scale.grad, expected, rtol=1e-6, atol=0.0)


# ---------------------------------------------------------------------------------------------
# BatchNorm


def _batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def test_a_split_through_batchnorm_warns_once_naming_the_layer() -> None:
    model = _batchnorm_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    with pytest.warns(UserWarning, match=r"BatchNorm layers in training mode \(BatchNorm1d '1'\)") as record:
        for seed in range(3):
            step.backward(_batch(12, seed=seed), _mse(model))
    assert sum("BatchNorm" in str(w.message) for w in record) == 1


def test_no_batchnorm_warning_without_a_split_or_in_eval_mode() -> None:
    model = _batchnorm_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eb.ElasticStep(model).backward(_batch(12), _mse(model))
        model.eval()
        eb.ElasticStep(model, controller=eb.SplitController(split_count=3)).backward(_batch(12), _mse(model))


def test_batchnorm_stops_the_split_before_a_microbatch_of_one_row() -> None:
    model = _batchnorm_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    batch = _batch(6)

    def loss_fn(mb: Batch) -> torch.Tensor:
        if len(mb[0]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return _mse(model)(mb)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step.backward(batch, loss_fn)  # 6 -> 3 -> 2 rows: still fits the rule
    assert step.controller.split_count == 3

    def always(mb: Batch) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with pytest.raises(eb.ElasticOOMError, match=r"BatchNorm1d '1' cannot normalise.*min_microbatch_size=2"):
        step.backward(batch, always)


@pytest.mark.parametrize(("rows", "split", "pieces"), [(2, 2, [2]), (5, 3, [3, 2])], ids=["2-rows-at-2", "5-rows-at-3"])
def test_a_split_count_given_from_the_start_keeps_the_batchnorm_floor(rows: int, split: int, pieces: list[int]) -> None:
    """A tag or a starting count never cuts one-row microbatches through a training-mode BatchNorm (torch raised)."""
    model = _batchnorm_model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split))
    seen: list[int] = []

    def loss_fn(mb: Batch) -> torch.Tensor:
        seen.append(len(mb[0]))
        return _mse(model)(mb)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step.backward(_batch(rows), loss_fn)
    assert seen == pieces and step.controller.split_count == len(pieces)


# ---------------------------------------------------------------------------------------------
# An OOM, then another error in the retry


def test_an_error_after_an_oom_keeps_what_the_oom_taught_and_nothing_else() -> None:
    model = _model()
    controller = eb.SplitController(split_count=2)
    step = eb.ElasticStep(model, controller=controller)
    attempts = [0]

    def loss_fn(mb: Batch) -> torch.Tensor:
        attempts[0] += 1
        if attempts[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        raise Boom("in the retry")

    with pytest.raises(Boom, match="in the retry"):
        step.backward(_batch(12), loss_fn)
    state = controller.state_dict()
    assert (state["fails"], state["fits"], state["oom_count"], state["retry_count"]) == (6, 0, 1, 1)
    assert controller.split_count == 4  # what the OOM taught: microbatches of 3, not 6


# ---------------------------------------------------------------------------------------------
# Misuse


def test_a_loss_through_parameters_outside_the_model_is_refused_at_the_first_step() -> None:
    model = _model()
    step = eb.ElasticStep(model[0], controller=eb.SplitController(split_count=2))  # the first layer only
    with pytest.raises(
        ValueError, match=r"trains 2 tensor\(s\) that are neither parameters .*\(shapes \(1, 16\), \(1,\)\)"
    ):
        step.backward(_batch(12), _mse(model))
    assert all(p.grad is None for p in model.parameters())


def test_batch_tensors_that_require_grad_are_not_foreign() -> None:
    model = _model()
    x, y = _batch(12)
    x.requires_grad_(True)
    eb.ElasticStep(model, controller=eb.SplitController(split_count=2)).backward((x, y), _mse(model))
    assert x.grad is not None


def test_a_batch_tagged_by_another_controller_warns_once(forget_warnings: Callable[[], None]) -> None:
    loader = eb.MicrobatchingDataLoader(torch.utils.data.TensorDataset(*_batch(24)), batch_size=12)
    model = _model()
    step = eb.ElasticStep(model)  # forgot controller=loader.controller
    with pytest.warns(UserWarning, match=r"tagged by another SplitController.*controller=loader\.controller") as record:
        for batch in loader:
            step.backward(batch, _mse(model))
    assert len(record) == 1
    forget_warnings()  # else the block below could not warn at all: warn_once said it already
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = eb.ElasticStep(model, controller=loader.controller)
        for batch in loader:
            shared.backward(batch, _mse(model))


def test_on_a_cpu_the_controller_says_it_has_no_memory_probe() -> None:
    model = _model()
    step = eb.ElasticStep(model)  # memory="auto": no probe on a CPU
    step.backward(_batch(12), _mse(model))
    assert "memory='nothing measured: no memory probe on cpu (the OOM-driven search plans)'" in repr(step.controller)
