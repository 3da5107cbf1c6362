"""The fault-injection matrix: where an OOM strikes, on which ranks, and what must follow.

A *cell* is one combination of

* the loop: ``"plain"`` (``ElasticStep.backward`` + ``ElasticStep.optimizer_step``) or
  ``"lightning"`` (``elastic_batches.lightning.Trainer(accumulate_grad_batches="auto")``);
* the setting: ``"single"`` (one process), ``"ddp"``, ``"fsdp2"`` (``gather="auto"``: this model
  gathers once an attempt), ``"fsdp2-module"`` (``gather="module"``, each collective guarded) or,
  in the plain loop, ``"fsdp2-script"`` (the same, its first attempt at the OOM following the
  script that two warm-up attempts agreed on), ``"fsdp2-eval"`` (the same, with a validation,
  ``step.evaluate`` and a bare ``torch.no_grad()`` forward, between step 0 and the step of the
  OOM: the script stays in use) or ``"ddp-overlap"`` (DDP in buckets small enough that the last
  microbatch's backward starts all but the vote's) on two gloo ranks;
* the phase the OOM strikes in: the device ``"transfer"`` of a microbatch, the ``"cut"`` of a
  padded microbatch (a loader with ``pad_values``), the ``"count"`` of its items (``count_fn``),
  its ``"forward"``, its ``"backward"`` (injected on the first layer, so later layers already
  hold gradients; under ``"ddp-overlap"`` after the last microbatch's backward started some buckets),
  ``"bucket"`` (``"ddp-overlap"`` only: in that backward, where it starts the first, middle or
  last bucket of its schedule), the ``"sum"`` of the microbatch losses (``aten.stack``), the gradient norm of
  the ``"clip"``ping, the optimizer ``"step"``, or (Lightning only) a user ``"hook"``,
  ``on_before_optimizer_step``, which Lightning runs between the two;
* the microbatch: ``"first"``, ``"middle"`` or ``"last"`` of the attempt (per-microbatch phases);
* the ranks: ``"0"``, ``"1"`` or ``"both"`` (rank 0 in the first attempt, rank 1 in the retry
  that follows it; both in the same step for the phases after the microbatches).

Every cell trains a tiny model for ``STEPS`` steps of ``GLOBAL_ROWS`` samples (over all ranks),
starting at ``SPLIT`` microbatches, with the OOM injected in step ``OOM_STEP``. The model holds a
per-sample ``nn.Embedding(SAMPLES, 1)`` whose value is added to each sample's loss, so the
gradient of row ``id`` is exactly ``1 / GLOBAL_ROWS`` when sample ``id`` was used once in the
step, 0 when it was lost, ``2 / GLOBAL_ROWS`` when it was counted twice: every row is checked
after every backward. The outcome must be

* for everything between the start of an attempt and the vote (transfer, cut, count, forward,
  backward, sum): recovery, with weights equal (``RTOL``) to plain full-batch training on the
  same samples, which never ran out of memory;
* after the microbatches (hook, clipping, optimizer step), where splitting cannot help: an
  ``ElasticOOMError`` on every rank, naming where (``WHERE``, ``LIGHTNING_WHERE``) and the ranks,
  with the weights of the steps before it (no partial update) on the ranks that ran out of
  memory, and on every rank when the norm's vote caught it before any rank stepped; after an OOM
  in the step itself, the ranks whose step went through hold its update (documented, checked on
  each rank's own shards);

and never a hang (the distributed cells run in :class:`support.ranks.RankPool` under a
deadline).

``tests/test_fault_matrix.py`` asserts all of this; ``benchmarks/fault_matrix.py`` runs the same
cells and prints the table of ``docs/reliability.md``. The package: ``cells`` (what a cell is, its
data, model and reference, what it must show), ``plain`` and ``lightning`` (running a cell in each
loop), ``checks`` (judging its results), ``jobs`` (a setting's cells on one rank), ``experts``
(the mixture-of-experts cells: ranks whose rows go to different experts), ``churn``
(OOM-and-retry cycles and memory that changes, measured).
"""

from support.fault_matrix.cells import (
    EVALUATED,
    FEATURES,
    GATHER,
    GLOBAL_ROWS,
    ID_TOLERANCE,
    LIGHTNING_PHASES,
    LIGHTNING_WHERE,
    LOOP_SETTINGS,
    LOOPS,
    LR,
    MAX_GRAD_NORM,
    MICROBATCH_PHASES,
    OOM_STEP,
    OVERLAP_BUCKET_BYTES,
    OVERLAPPED,
    PHASES,
    POSITIONS,
    RECOVERING_PHASES,
    RTOL,
    SAMPLES,
    SCRIPTED,
    SCRIPTED_SETTINGS,
    SETTINGS,
    SPLIT,
    STEPS,
    WHERE,
    WIDTH,
    Cell,
    IdModel,
    batch,
    cells,
    dataset,
    expected_outcome,
    flat,
    loss_of,
    oom_call,
    pad_length,
    padded_batch,
    padded_loss,
    predicted_counts,
    reference,
    relative_error,
    step_ids,
)
from support.fault_matrix.checks import id_check, outcome, problems, weight_errors
from support.fault_matrix.experts import (
    ExpertCell,
    expert_cells,
    expert_outcome,
    expert_problems,
    run_expert_cells,
)
from support.fault_matrix.jobs import run_cells
from support.fault_matrix.lightning import (
    lightning_environment,
    run_lightning_cell,
    run_lightning_validation,
    validation_reference,
)
from support.fault_matrix.plain import GradNormOOM, distribute, error_of, result_of, run_plain_cell

__all__ = [
    "Cell",
    "EVALUATED",
    "ExpertCell",
    "FEATURES",
    "GATHER",
    "GLOBAL_ROWS",
    "GradNormOOM",
    "ID_TOLERANCE",
    "IdModel",
    "LIGHTNING_PHASES",
    "LIGHTNING_WHERE",
    "LOOPS",
    "LR",
    "MAX_GRAD_NORM",
    "MICROBATCH_PHASES",
    "OOM_STEP",
    "OVERLAP_BUCKET_BYTES",
    "OVERLAPPED",
    "PHASES",
    "POSITIONS",
    "RECOVERING_PHASES",
    "RTOL",
    "SAMPLES",
    "SETTINGS",
    "LOOP_SETTINGS",
    "SCRIPTED",
    "SCRIPTED_SETTINGS",
    "SPLIT",
    "STEPS",
    "WHERE",
    "WIDTH",
    "batch",
    "cells",
    "dataset",
    "distribute",
    "error_of",
    "expected_outcome",
    "expert_cells",
    "expert_outcome",
    "expert_problems",
    "flat",
    "id_check",
    "lightning_environment",
    "loss_of",
    "oom_call",
    "outcome",
    "pad_length",
    "padded_batch",
    "padded_loss",
    "predicted_counts",
    "problems",
    "reference",
    "relative_error",
    "result_of",
    "run_cells",
    "run_expert_cells",
    "run_lightning_cell",
    "run_lightning_validation",
    "run_plain_cell",
    "step_ids",
    "validation_reference",
    "weight_errors",
]
