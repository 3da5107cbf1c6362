"""Distributed through Accelerate: the elastic HF Trainer on 2 processes, and a plain Accelerate loop.

Every multi-process run is ``torchrun --nproc-per-node 2`` or ``accelerate launch`` on CPUs (gloo),
in a session of its own with a hard deadline, after which every process it started is killed and
the test fails with the output. Rank 1 runs inside a smaller ``MemoryBudget`` than rank 0: both
ranks must agree (the same OOM count, no hang), and the weights equal the single-process run at
the same global batch within 1e-5 relative.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
RTOL = 1e-5
DEADLINE = 420.0  # seconds for one launch of 2 processes on a loaded 2-core machine
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
ACCELERATE = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",  # Accelerate's multi-process launcher; the script's Accelerator(cpu=True) makes it gloo on CPUs
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def launch(command: list[str], out: Path) -> dict[str, Any]:
    """Run ``command`` under the deadline; what its rank 0 saved to ``out``."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # the scripts import support.hf_models
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            process.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.seek(0)
        output = log.read()
    if process.returncode == -signal.SIGKILL:
        pytest.fail(f"{command[-1]} did not finish in {DEADLINE:.0f}s (a hang?); its output:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return torch.load(out, weights_only=False)


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """``|got - want| / |want - start|``: the error against the size of the update."""
    error = sum(float((got[k] - want[k]).pow(2).sum()) for k in want) ** 0.5
    return error / sum(float((want[k] - start[k]).pow(2).sum()) for k in want) ** 0.5


@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulation-2"])
def test_hf_trainer_on_two_processes_equals_one_process_at_the_same_global_batch(
    accumulate: int, tmp_path: Path
) -> None:
    from support.hf_models import tiny_gpt2

    script = [str(SCRIPTS / "hf_trainer_ddp.py"), "--accumulate", str(accumulate)]
    one = tmp_path / "one.pt"
    want = launch([sys.executable, *script, "--out", str(one), "--batch", "32", "--budgets", "0"], one)
    out = tmp_path / "two.pt"
    got = launch(
        [*TORCHRUN, *script, "--out", str(out), "--batch", "16", "--budgets", "0", "1500000", "--elastic"], out
    )
    ooms = got["ooms"]
    assert ooms[0] == ooms[1] >= 1  # rank 1 ran out of memory, rank 0 learned of it: both split alike
    start = tiny_gpt2().state_dict()
    assert relative(got["weights"], want["weights"], start) < RTOL
    losses = [entry["loss"] for entry in got["logs"] if "loss" in entry]
    assert losses == pytest.approx([entry["loss"] for entry in want["logs"] if "loss" in entry], rel=RTOL)


def _loop_script() -> Any:
    spec = importlib.util.spec_from_file_location("accelerate_loop", SCRIPTS / "accelerate_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_batch_reference(rows: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The plain loop's weights after its steps at the full batch of ``rows``, and the initial weights."""
    loop = _loop_script()
    model, data = loop.model_and_data(rows)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in torch.utils.data.DataLoader(data, batch_size=rows):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), start


# Under accelerate.accumulate on 2 processes the batch of a rank is 256 / (2 x 2) = 64 rows, not 16: the second
# batch of an accumulation holds its gradient and the first's (32 KiB for the first layer), and a split one a
# microbatch's gradient besides, as much as 16 rows' activations (35 KiB), so no budget OOMs at 16 rows and fits 1.
LOOPS = [
    pytest.param([], ["150000"], 1, 64, id="one-process"),
    pytest.param([], ["130000"], 2, 64, id="one-process-accumulate-2"),
    pytest.param(ACCELERATE, ["0", "130000"], 1, 64, id="accelerate-launch-2-processes"),
    pytest.param(ACCELERATE, ["0", "200000"], 2, 256, id="accelerate-launch-2-processes-accumulate-2"),
]


@pytest.mark.parametrize(("launcher", "budgets", "accumulate", "rows"), LOOPS)
def test_plain_accelerate_loop_with_elastic_step_is_exact(
    launcher: list[str], budgets: list[str], accumulate: int, rows: int, tmp_path: Path
) -> None:
    out = tmp_path / "loop.pt"
    script = [str(SCRIPTS / "accelerate_loop.py"), "--out", str(out), "--budgets", *budgets, "--rows", str(rows)]
    command = [*(launcher or [sys.executable]), *script, "--accumulate", str(accumulate)]
    got = launch(command, out)
    assert len(got["ooms"]) == len(budgets) and got["ooms"][0] >= 1
    assert len(set(got["ooms"])) == 1  # the ranks agreed on every OOM
    want, start = full_batch_reference(rows)
    assert relative(got["weights"], want, start) < RTOL
