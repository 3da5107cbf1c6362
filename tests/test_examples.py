"""Every example in ``examples/`` runs, small, so that none rots; so do the code blocks of the docs.

Each example is one parametrized case: its command line at a small size and a line its output
must contain. Only examples that exist are listed; add a row to ``EXAMPLES`` with each new one.
The Python code blocks of ``README.md`` and of every page of ``docs/`` run too, in order, each
page in one namespace and a process of its own, as a reader would paste them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Example(NamedTuple):
    script: str
    args: tuple[str, ...]
    expect: str  # a line fragment the output must contain
    launcher: tuple[str, ...] = ()  # e.g. torchrun for a multi-process example
    timeout: float = 300.0


TORCHRUN = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone")

EXAMPLES = [
    Example("plain_loop.py", ("--small",), "a resumed loader starts at 3 microbatches per batch"),
    Example("causal_lm.py", ("--quick",), "'gradient_error'"),
    Example("ddp_torchrun.py", ("--steps", "2"), "agreed split count", launcher=TORCHRUN, timeout=180.0),
    Example("lightning_auto.py", ("--quick",), "weights vs the plain Trainer"),
    Example("lightning_ddp.py", ("--quick",), "RESULT", timeout=180.0),
]

CASES = [pytest.param(e, id=e.script) for e in EXAMPLES if (ROOT / "examples" / e.script).exists()]


@pytest.mark.parametrize("example", CASES)
def test_example_runs_small(example: Example) -> None:
    command = [sys.executable, *example.launcher, str(ROOT / "examples" / example.script), *example.args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # A session of its own, so that a hang (in a multi-process example) is ended with every process it started.
    # Output goes to a file, not a pipe: a worker that outlives its launcher cannot block the read.
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            process.wait(timeout=example.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _kill_processes_running(example.script)  # torchrun starts its workers in sessions of their own
            process.wait()
        log.seek(0)
        output = log.read()
    if process.returncode == -signal.SIGKILL:
        pytest.fail(f"{example.script} did not finish in {example.timeout:.0f}s; its output:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    assert example.expect in output, output[-4000:]


def _kill_processes_running(script: str) -> None:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            pid = int(cmdline.parent.name)
            if pid != os.getpid() and script.encode() in cmdline.read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone already, or not ours to kill


def test_every_example_is_listed() -> None:
    listed = {e.script for e in EXAMPLES}
    unlisted = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name not in listed)
    assert not unlisted, f"add a row to EXAMPLES in tests/test_examples.py for {unlisted}, so that CI runs them"


DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from run_doc_blocks import python_blocks  # noqa: E402 - the runner's own parser


def test_the_pages_with_code_blocks_include_the_readme_and_the_quick_start() -> None:
    with_code = [d for d in DOCUMENTS if python_blocks((ROOT / d).read_text())]
    assert {"README.md", "docs/quickstart.md", "docs/recipes.md", "docs/testing.md"} <= set(with_code)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_code_blocks_of_the_docs_run(document: str, tmp_path: Path) -> None:
    if not python_blocks((ROOT / document).read_text()):
        return  # a page of prose and tables: nothing to run
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "run_doc_blocks.py"), str(ROOT / document)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_a_printed_number_that_the_comment_misstates_fails_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text('```python\nx = 5\nprint(x, "a # b")  # 5, and prose\nprint(x + 1)  # 7 rows\n```\n')
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "run_doc_blocks.py"), str(page)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "page.md[block 0] line 3: the comment shows ['7'], which the call did not print" in result.stderr
    assert result.stdout.startswith("5 a # b\n6\n")
