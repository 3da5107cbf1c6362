from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from elastic_batches.testing import MemoryBudget, OOMInjection, inject_oom, inject_oom_in_optimizer


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _train_step(model: nn.Module, budget: MemoryBudget, batch: int, seq: int | None = None) -> None:
    shape = (batch, 256) if seq is None else (batch, seq, 256)
    with budget:
        x = torch.randn(*shape)
        loss = model(x).pow(2).mean()
        loss.backward()


# ----------------------------------------------------------------------------- MemoryBudget


def test_parameters_created_outside_are_not_counted() -> None:
    layer = nn.Linear(256, 256)
    with MemoryBudget() as budget:
        weight_t = layer.weight.t()  # a view of an outside storage
        layer.bias.data.add_(0)  # an in-place write into an outside storage
    assert weight_t.shape == (256, 256)
    assert budget.live_bytes == 0
    assert budget.peak_bytes == 0


def test_gradients_of_a_step_count_and_everything_else_is_freed() -> None:
    model = _mlp()
    budget = MemoryBudget()
    _train_step(model, budget, batch=64)
    assert budget.live_bytes == _param_bytes(model)  # only the .grad tensors are left
    model.zero_grad(set_to_none=True)
    assert budget.live_bytes == 0  # back to where the step started


@pytest.mark.parametrize(
    ("sizes", "seq"),
    [((64, 128), None), ((2, 4), 32)],
    ids=["batch-64-vs-128", "seq32-batch-2-vs-4"],
)
def test_activation_memory_grows_linearly_with_batch(sizes: tuple[int, int], seq: int | None) -> None:
    activation = []
    for batch in sizes:
        model = _mlp()
        budget = MemoryBudget()
        _train_step(model, budget, batch=batch, seq=seq)
        activation.append(budget.peak_bytes - _param_bytes(model))  # peak minus the gradients
    assert activation[0] > 0
    assert 1.6 <= activation[1] / activation[0] <= 2.4


def test_activation_memory_grows_with_sequence_length() -> None:
    peaks = []
    for seq in (16, 64):
        model = _mlp()
        budget = MemoryBudget()
        _train_step(model, budget, batch=2, seq=seq)
        peaks.append(budget.peak_bytes - _param_bytes(model))
    assert 3.2 <= peaks[1] / peaks[0] <= 4.8


def test_op_past_the_limit_raises_real_oom_and_is_not_counted() -> None:
    budget = MemoryBudget(limit_bytes=8192)
    with budget:
        kept = torch.zeros(1024)  # 4 KiB
        with pytest.raises(
            torch.OutOfMemoryError,
            match=r"out of memory\. Tried to allocate 8\.00 KiB; 4\.00 KiB in use, limit 8\.00 KiB "
            r"\(elastic_batches\.testing\.MemoryBudget",
        ):
            torch.zeros(2048)
    assert budget.oom_count == 1
    assert budget.live_bytes == 4096  # the failed op's output is not counted
    assert budget.peak_bytes == 4096
    del kept
    assert budget.live_bytes == 0


def test_oom_is_a_runtime_error_as_on_cuda() -> None:
    budget = MemoryBudget(limit_bytes=0)
    with budget, pytest.raises(RuntimeError, match="CUDA out of memory"):
        torch.ones(1)
    assert budget.oom_count == 1


def test_limit_can_change_between_steps() -> None:
    model = _mlp()
    budget = MemoryBudget(limit_bytes=None)
    _train_step(model, budget, batch=32)
    needed = budget.peak_bytes
    model.zero_grad(set_to_none=True)
    budget.limit_bytes = needed - 1
    with pytest.raises(torch.OutOfMemoryError):
        _train_step(model, budget, batch=32)
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert budget.live_bytes == 0  # the failed step's tensors were all freed
    budget.limit_bytes = needed
    _train_step(model, budget, batch=32)
    assert budget.oom_count == 1


def test_oom_in_backward_surfaces_as_out_of_memory_error() -> None:
    model = _mlp()
    budget = MemoryBudget()
    with budget:
        loss = model(torch.randn(64, 256)).sum()
    budget.limit_bytes = budget.live_bytes + 1024  # room for no gradient matrix
    with budget, pytest.raises(torch.OutOfMemoryError, match="MemoryBudget"):
        loss.backward()
    assert budget.oom_count == 1


def test_views_are_not_double_counted() -> None:
    with MemoryBudget() as budget:
        x = torch.zeros(16, 16)  # 1 KiB
        views = [x[2:5], x.t(), x.view(256), x.reshape(4, 64), x.detach(), x.unsqueeze(0), *x.split(4)]
        x.add_(1)  # in place
        x.mul_(2)[0].zero_()
    assert len(views) == 10
    assert budget.live_bytes == 1024
    del x
    assert budget.live_bytes == 1024  # the views keep the storage alive
    del views
    assert budget.live_bytes == 0


def test_out_tensor_resized_by_an_op_counts_its_growth() -> None:
    with MemoryBudget() as budget:
        out = torch.empty(0)
        torch.add(torch.ones(8), 1, out=out)  # out is resized to 32 bytes; the ones(8) is freed
    assert budget.live_bytes == 32
    assert budget.peak_bytes == 64


def test_saved_activations_stay_counted_until_backward_frees_them() -> None:
    weight = torch.randn(128, 128, requires_grad=True)  # created outside: not counted

    def forward() -> torch.Tensor:
        hidden = torch.randn(32, 128) @ weight  # saved by tanh for backward
        return hidden.tanh().sum()  # Python refs to hidden are dropped on return

    budget = MemoryBudget()
    with budget:
        loss = forward()
    gc.collect()
    activations = budget.live_bytes
    assert activations >= 2 * 32 * 128 * 4  # the input of mm and the tanh output/input are still alive
    with budget:
        loss.backward()
    del loss
    assert budget.live_bytes == weight.numel() * 4  # only weight.grad is left


def test_reset_peak_and_repr() -> None:
    budget = MemoryBudget(limit_bytes=1 << 20)
    with budget:
        x = torch.zeros(256)
        y = torch.zeros(256)
        del y
    assert budget.peak_bytes == 2048
    budget.reset_peak()
    assert budget.peak_bytes == 1024 == budget.live_bytes
    assert "MemoryBudget(limit=1.00 MiB, live=1.00 KiB" in repr(budget)
    del x


def test_reentering_and_nesting_count_each_storage_once() -> None:
    budget = MemoryBudget()
    with budget:
        a = torch.ones(10)
        with budget:
            b = torch.ones(10)
    with budget:
        c = torch.ones(10)
    assert (a.numel(), b.numel(), c.numel()) == (10, 10, 10)
    assert budget.live_bytes == 120


def test_two_budgets_nest_and_both_count() -> None:
    outer, inner = MemoryBudget(), MemoryBudget()
    with outer:
        a = torch.ones(10)
        with inner:
            b = torch.ones(10)
    assert (a.numel(), b.numel()) == (10, 10)
    assert (outer.live_bytes, inner.live_bytes) == (80, 40)


@pytest.mark.parametrize("budget_outside", [True, False], ids=["budget-outside-autocast", "budget-inside-autocast"])
def test_nests_with_autocast(budget_outside: bool) -> None:
    model = _mlp()
    budget = MemoryBudget()
    if budget_outside:
        with budget, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(8, 256))
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16), budget:
            out = model(torch.randn(8, 256))
    assert out.dtype == torch.bfloat16
    assert budget.live_bytes > 0


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [(-1, ValueError, r"limit_bytes must be >= 0, got -1"), (1.5, TypeError, r"must be an int number of bytes")],
    ids=["negative", "float"],
)
def test_bad_limit_is_rejected(limit: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        MemoryBudget(limit_bytes=limit)  # type: ignore[arg-type]


def test_bad_limit_is_rejected_by_the_setter() -> None:
    budget = MemoryBudget()
    with pytest.raises(ValueError, match="or None to only measure"):
        budget.limit_bytes = -5


# ----------------------------------------------------------------------------- inject_oom


def _run_calls(model: nn.Module, n: int, *, backward: bool) -> list[int]:
    """Runs n forward (and backward) calls; returns the call numbers that raised."""
    raised = []
    for i in range(n):
        try:
            out = model(torch.ones(2, 4))
            if backward:
                out.sum().backward()
        except torch.OutOfMemoryError:
            raised.append(i)
    return raised


@pytest.mark.parametrize("calls", [0, [1, 3], range(2, 4)], ids=["int", "list", "range"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_injection_fires_exactly_at_the_chosen_calls(phase: str, calls: int | list[int] | range) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with inject_oom(model, phase=phase, calls=calls) as oom:  # type: ignore[arg-type]
        raised = _run_calls(model, 5, backward=True)
    expected = [calls] if isinstance(calls, int) else list(calls)
    assert raised == expected
    assert (oom.fired, oom.calls_seen) == (len(expected), 5)
    assert _run_calls(model, 2, backward=True) == []  # removed on exit


def test_forward_injection_raises_before_the_module_runs() -> None:
    model = nn.Linear(4, 1)
    ran = []
    model.register_forward_hook(lambda *_: ran.append(True))
    with (
        inject_oom(model, phase="forward", calls=0),
        pytest.raises(
            torch.OutOfMemoryError, match=r"injected by elastic_batches\.testing at forward call 0 of Linear"
        ),
    ):
        model(torch.ones(1, 4))
    assert ran == []


def test_backward_injection_strikes_after_later_layers_got_gradients() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with inject_oom(model[0], phase="backward", calls=0) as oom:
        loss = model(torch.ones(3, 4)).sum()  # forward is not affected
        with pytest.raises(
            torch.OutOfMemoryError, match=r"injected by elastic_batches\.testing in backward of forward call 0"
        ):
            loss.backward()
    assert model[2].weight.grad is not None
    assert model[0].weight.grad is None
    assert oom.fired == 1


def test_microbatches_of_a_step_are_consecutive_calls() -> None:
    model = nn.Linear(4, 1)
    batch = torch.ones(8, 4)
    with inject_oom(model, phase="backward", calls=[2]) as oom:
        failed_at = None
        for i, micro in enumerate(batch.tensor_split(4)):  # one step of 4 microbatches
            try:
                model(micro).sum().backward()
            except torch.OutOfMemoryError:
                failed_at = i
    assert failed_at == 2
    assert oom.calls_seen == 4


def test_backward_injection_fires_once_for_a_module_with_several_outputs() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 1)
            self.b = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"a": self.a(x), "b": self.b(x)}

    model = TwoHeads()
    with inject_oom(model, phase="backward", calls=0) as oom:
        out = model(torch.ones(2, 4))
        loss = out["a"].sum() + out["b"].sum()
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward(retain_graph=True)
        loss.backward()  # the same call's graph again: already fired
    assert oom.fired == 1


def test_removed_backward_injection_does_not_fire_on_a_pending_graph() -> None:
    model = nn.Linear(4, 1)
    oom = inject_oom(model, phase="backward", calls=0)
    loss = model(torch.ones(2, 4)).sum()
    oom.remove()
    oom.remove()  # twice is fine
    loss.backward()
    assert oom.fired == 0
    assert oom.calls_seen == 1


def test_backward_injection_under_no_grad_never_fires() -> None:
    model = nn.Linear(4, 1)
    with inject_oom(model, phase="backward", calls=0) as oom, torch.no_grad():
        model(torch.ones(2, 4))
    assert (oom.fired, oom.calls_seen) == (0, 1)


@pytest.mark.parametrize(
    ("dist_rank", "rank", "fires"),
    [
        (None, None, True),
        (None, 0, True),
        (None, 1, False),
        (1, None, True),
        (1, 1, True),
        (1, 0, False),
    ],
    ids=["no-dist-any", "no-dist-rank0", "no-dist-rank1", "rank1-any", "rank1-match", "rank1-other"],
)
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_rank_filter(
    monkeypatch: pytest.MonkeyPatch, phase: str, dist_rank: int | None, rank: int | None, fires: bool
) -> None:
    if dist_rank is not None:
        monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: dist_rank)
    model = nn.Linear(4, 1)
    with inject_oom(model, phase=phase, calls=[0, 1], rank=rank) as oom:  # type: ignore[arg-type]
        raised = _run_calls(model, 3, backward=True)
    assert raised == ([0, 1] if fires else [])
    assert oom.calls_seen == 3  # every rank counts, whether or not it raises


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"phase": "fwd"}, ValueError, r"unknown phase 'fwd': use phase='forward' or phase='backward'"),
        ({"phase": "forward", "calls": -1}, ValueError, r"numbers >= 0 .* got -1"),
        ({"phase": "forward", "calls": []}, ValueError, r"calls is empty"),
        ({"phase": "forward", "calls": ["0"]}, TypeError, r"must hold int forward call numbers, got '0'"),
        ({"phase": "forward", "rank": -1}, ValueError, r"rank must be a torch\.distributed rank >= 0 or None"),
    ],
    ids=["phase", "negative-call", "empty-calls", "str-call", "negative-rank"],
)
def test_bad_injection_arguments_are_rejected(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        inject_oom(nn.Linear(1, 1), **kwargs)  # type: ignore[arg-type]


def test_inject_oom_needs_a_module() -> None:
    with pytest.raises(TypeError, match="needs an nn.Module, got function"):
        inject_oom(lambda x: x, phase="forward")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- optimizer


def test_optimizer_injection_raises_before_touching_parameters() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    with inject_oom_in_optimizer(opt, calls=[1]) as oom:
        opt.step()
        before = model.weight.detach().clone()
        with pytest.raises(
            torch.OutOfMemoryError, match=r"injected by elastic_batches\.testing at optimizer step 1 of SGD"
        ):
            opt.step()
        assert torch.equal(model.weight, before)
        opt.step()
    assert isinstance(oom, OOMInjection)
    assert (oom.fired, oom.calls_seen) == (1, 3)
    assert "calls=[1]" in repr(oom)


def test_optimizer_injection_respects_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with inject_oom_in_optimizer(opt, calls=0, rank=1) as oom:
        opt.step()
    assert (oom.fired, oom.calls_seen) == (0, 1)


def test_inject_oom_in_optimizer_needs_an_optimizer() -> None:
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got Linear"):
        inject_oom_in_optimizer(nn.Linear(1, 1))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the module

_IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import elastic_batches.testing as testing
after_init = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "transformers"))
names = [m.name for m in pkgutil.walk_packages(testing.__path__, "elastic_batches.testing.")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "transformers"))
print(json.dumps({"after_init": after_init, "modules": names, "heavy": heavy}))
"""


def test_the_testing_module_imports_no_lightning_and_holds_no_harness() -> None:
    """In a fresh process: ``import elastic_batches.testing``, then every module under it, leaves Lightning unloaded.

    The project's harness (rank pools, fault matrix, Hugging Face clients) lives in ``tests/support/``, not here.
    """
    result = subprocess.run([sys.executable, "-c", _IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["after_init"] == [] and found["heavy"] == []
    assert "elastic_batches.testing.memory" in found["modules"]  # the walk did see the package's modules
    harness = {"fault_matrix", "ranks", "models", "hf_models"}
    assert [m for m in found["modules"] if m.split(".")[2] in harness] == []
