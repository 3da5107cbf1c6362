"""Real CUDA out-of-memory errors: ``ElasticStep`` catches them, retries, and leaves the full-batch gradient.

Needs a CUDA device; without one it says so and exits 0 (``make bench`` runs every script). On
one GPU it checks, and prints:

1. **The gradient.** The demo's transformer LM, made wider, on a batch whose full-batch step
   needs more memory than a cap set for this check (``torch.cuda.set_per_process_memory_fraction``,
   about 40% of the way from what the model needs without activations to the full batch's
   peak). The first attempts raise ``torch.OutOfMemoryError`` from the CUDA caching allocator
   itself; the step retries at larger split counts, and its gradient equals the full-batch
   gradient computed before the cap (float32, TF32 off) within 1e-5 relative.
2. **The memory.** After the retries, the allocated bytes are those before the step plus the
   gradients: nothing of a failed attempt stays alive.
3. **The search.** Today's OOM-driven search (``SplitController(margin=None)``, no memory probe):
   a few more steps let it settle (at most ceil(log2 B) + 4 OOMs in all); then steps at the
   settled count raise no OOM, and their time is compared with a hand-written loop at the same
   split (``ElasticStep``'s overhead on a GPU).
4. **The prediction.** A fresh ``SplitController()`` (margin 5%) with the step's CUDA probe
   (``memory="auto"``) under the same cap: the OOMs it spends until its count stops changing
   (the target: at most 1, and 0 OOMs afterwards), its first step's gradient (a measuring
   microbatch, then pieces of other sizes) against the full batch's, and per microbatch measured
   once the model was fitted, the predicted against the measured peak over the memory in use
   before the microbatch (relative error, median and largest). Then the throughput (rows/s) of
   the settled plan against the best of a sweep of fixed microbatch sizes, each run as a
   hand-written loop (sizes that OOM are left out).

Run: ``python benchmarks/cuda_oom.py``. Exit status 1 if a check fails. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Any

import torch
from _harness import emit, table

from elastic_batches import ElasticStep, SplitController
from elastic_batches.demo import DemoConfig
from elastic_batches.demo_model import lm_loss
from elastic_batches.memory import MemoryModel
from elastic_batches.oom import is_oom_error, release_memory

RTOL = 1e-5
SETTLING_STEPS = 5
STEADY_STEPS = 10
PREDICTED_STEPS = 6
SWEEP = (1, 2, 4, 8, 16, 32, 64)  # fixed microbatch sizes (rows) for the throughput comparison


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want, strict=True))


def _timed(fn: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _record_predictions(model: MemoryModel) -> list[tuple[int, int, int]]:
    """``(size, predicted, measured)`` bytes over the memory in use, per later microbatch, once the model is fitted."""
    records: list[tuple[int, int, int]] = []
    observe = model.observe

    def recorded(size: int, increment: int, *, first: bool, forward: int | None = None) -> None:
        if model.ready and not first:
            records.append((size, model.increment(size), increment))
        observe(size, increment, first=first, forward=forward)

    model.observe = recorded  # type: ignore[method-assign]
    return records


def _fixed_size_rate(
    loss_fn: Any, model: torch.nn.Module, tokens: torch.Tensor, size: int, repeats: int
) -> float | None:
    """Rows per second of a hand-written loop at microbatches of ``size`` rows; ``None`` if it runs out of memory."""
    pieces = [{"tokens": t} for t in tokens.split(size)]

    def by_hand() -> None:
        for piece in pieces:
            (loss_fn(piece) * (len(piece["tokens"]) / len(tokens))).backward()
        model.zero_grad(set_to_none=True)

    try:
        by_hand()  # warm-up, and whether it fits
        seconds = statistics.median(_timed(by_hand) for _ in range(repeats))
    except Exception as err:
        if not is_oom_error(err):
            raise
        del err
        model.zero_grad(set_to_none=True)
        release_memory()
        return None
    return len(tokens) / seconds


def _predicted(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss_fn: Any, reference: Any) -> dict[str, Any]:
    """Part 4: the predicting controller under the cap; OOMs to settle, gradient, prediction error, throughput."""
    tokens = batch["tokens"]
    controller = SplitController()
    assert controller.memory is not None
    records = _record_predictions(controller.memory)
    step = ElasticStep(model, controller=controller)  # memory="auto": the CUDA probe
    model.zero_grad(set_to_none=True)
    step.backward(batch, loss_fn)
    error = _relative_error(_gradients(model), reference)
    counts, ooms = [controller.split_count], [controller.oom_count]
    for _ in range(PREDICTED_STEPS - 1):
        model.zero_grad(set_to_none=True)
        step.backward(batch, loss_fn)
        counts.append(controller.split_count)
        ooms.append(controller.oom_count)
    model.zero_grad(set_to_none=True)
    settled = next(i for i in range(len(counts)) if len(set(counts[i:])) == 1)
    to_settle, after = ooms[settled], ooms[-1] - ooms[settled]
    errors = [abs(p - m) / m for _, p, m in records if m > 0]
    under = sum(p < m for _, p, m in records)

    def elastic() -> None:
        step.backward(batch, loss_fn)
        model.zero_grad(set_to_none=True)

    elastic()
    seconds = statistics.median(_timed(elastic) for _ in range(STEADY_STEPS))
    after += controller.oom_count - ooms[-1]
    settled_rate = len(tokens) / seconds
    size = math.ceil(len(tokens) / counts[-1])
    sweep = {m: _fixed_size_rate(loss_fn, model, tokens, m, STEADY_STEPS) for m in sorted({*SWEEP, size})}
    fitting = {m: r for m, r in sweep.items() if r is not None}
    best = max(fitting, key=lambda m: fitting[m]) if fitting else None
    return {
        "counts": counts,
        "ooms_until_settled": to_settle,
        "ooms_after_settled": after,
        "gradient_relative_error": error,
        "predictions": len(errors),
        "median_relative_error": statistics.median(errors) if errors else math.nan,
        "max_relative_error": max(errors) if errors else math.nan,
        "under_predicted": under,
        "settled_rows_per_s": settled_rate,
        "sweep_rows_per_s": {m: r for m, r in sweep.items()},
        "best_fixed_size": best,
        "settled_over_best": settled_rate / fitting[best] if best is not None else math.nan,
        "estimate": controller.memory.describe(),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_oom: no CUDA device here, nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction needs an index
    config = DemoConfig(batch_size=64, seq_len=512, vocab_size=8192, dim=512, heads=8, layers=4)
    torch.manual_seed(0)
    model = config.model().to(device)
    tokens = torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1), device=device)
    batch = {"tokens": tokens}

    def loss_fn(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(model, microbatch)

    # the full-batch gradient, and what the step needs with and without its activations
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lm_loss(model, batch).backward()
    peak = torch.cuda.max_memory_allocated()
    reference = _gradients(model)
    gradient_bytes = sum(g.numel() * g.element_size() for g in reference)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    # room for the weights, the reference gradients kept here and the step's own, and 40% of the activations
    cap = resting + 2 * gradient_bytes + int(0.4 * (peak - resting - 2 * gradient_bytes))
    torch.cuda.set_per_process_memory_fraction(cap / total, device)

    controller = SplitController(margin=None)  # today's search, no memory probe
    step = ElasticStep(model, controller=controller, memory=None)
    before = torch.cuda.memory_allocated()
    step.backward(batch, loss_fn)
    torch.cuda.synchronize()
    leftover = torch.cuda.memory_allocated() - before - gradient_bytes
    error = _relative_error(_gradients(model), reference)
    first_ooms = controller.oom_count
    for _ in range(SETTLING_STEPS):  # the search may still refine between what fitted and what failed
        model.zero_grad(set_to_none=True)
        step.backward(batch, loss_fn)
    model.zero_grad(set_to_none=True)
    ooms, count = controller.oom_count, controller.split_count

    pieces = [{"tokens": t} for t in tokens.tensor_split(count)]

    def by_hand() -> None:
        total_loss: Any = 0.0
        for piece in pieces:
            weighted = loss_fn(piece) * (len(piece["tokens"]) / len(tokens))
            weighted.backward()
            total_loss = total_loss + weighted.detach()
        model.zero_grad(set_to_none=True)

    def elastic() -> None:
        step.backward(batch, loss_fn)
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"by hand": [], "elastic": []}
    for round_ in range(STEADY_STEPS):
        for name, fn in ((("by hand", by_hand), ("elastic", elastic)))[:: 1 if round_ % 2 else -1]:
            times[name].append(_timed(fn))
    ratio = statistics.median(e / h for e, h in zip(times["elastic"], times["by hand"], strict=True))
    later_ooms = controller.oom_count - ooms
    predicted = _predicted(model, batch, loss_fn, reference)

    checks = {
        "real CUDA OOMs caught": first_ooms >= 1,
        f"gradient within {RTOL:g} of the full batch's": error <= RTOL,
        "no memory of a failed attempt left (< 1 MiB)": abs(leftover) < 2**20,
        "no OOM at the settled count": later_ooms == 0,
        "OOMs within ceil(log2 B) + 4": ooms <= math.ceil(math.log2(config.batch_size)) + 4,
        "predicted: at most 1 OOM until settled": predicted["ooms_until_settled"] <= 1,
        "predicted: no OOM after settling": predicted["ooms_after_settled"] == 0,
        f"predicted: gradient within {RTOL:g} of the full batch's": predicted["gradient_relative_error"] <= RTOL,
    }
    gpu = torch.cuda.get_device_name(device)
    print(f"cuda_oom on {gpu}: memory cap {cap / 2**30:.2f} GiB, full-batch step {peak / 2**30:.2f} GiB")
    rows = [
        ["OOMs in the first step / in all", f"{first_ooms} / {ooms}"],
        ["settled microbatches", f"{count} of at most {controller.microbatch_size} rows"],
        ["gradient relative error", f"{error:.2e}"],
        ["bytes left over after the retries", str(leftover)],
        ["OOMs in the steady steps", str(later_ooms)],
        ["ms/step by hand / elastic", f"{1e3 * statistics.median(times['by hand']):.2f} / "
                                      f"{1e3 * statistics.median(times['elastic']):.2f}"],
        ["elastic / by hand", f"{ratio:.3f}"],
        ["predicted: microbatches per step", " ".join(str(c) for c in predicted["counts"])],
        ["predicted: OOMs until settled / after", f"{predicted['ooms_until_settled']} / "
                                                  f"{predicted['ooms_after_settled']}"],
        ["predicted: gradient relative error", f"{predicted['gradient_relative_error']:.2e}"],
        ["predicted: peak over in use, relative error median / max",
         f"{predicted['median_relative_error']:.3f} / {predicted['max_relative_error']:.3f} "
         f"({predicted['predictions']} microbatches, {predicted['under_predicted']} under)"],
        ["predicted: memory model", predicted["estimate"]],
        ["predicted: settled rows/s / best fixed size's", f"{predicted['settled_rows_per_s']:.1f} / "
         f"{predicted['sweep_rows_per_s'].get(predicted['best_fixed_size']) or math.nan:.1f} "
         f"(size {predicted['best_fixed_size']})"],
        ["predicted: settled / best fixed", f"{predicted['settled_over_best']:.3f}"],
    ]  # fmt: skip
    print(table(["what", "value"], rows))
    for name, ok in checks.items():
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
    emit(
        {
            "benchmark": "cuda_oom",
            "device": gpu,
            "cap_bytes": cap,
            "full_batch_peak_bytes": peak,
            "first_step_ooms": first_ooms,
            "ooms": ooms,
            "split_count": count,
            "gradient_relative_error": error,
            "leftover_bytes": leftover,
            "steady_ooms": later_ooms,
            "ratio": ratio,
            "predicted": predicted,
            "checks": checks,
        }
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
