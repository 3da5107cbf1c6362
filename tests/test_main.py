"""The command line, ``python -m elastic_batches``: help, version, usage errors, ``bench --check``."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import elastic_batches
from elastic_batches import __main__ as cli


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_batches", *args], capture_output=True, text=True, timeout=120)


def test_help_prints_to_stdout_and_exits_0() -> None:
    result = _run("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: python -m elastic_batches [-h] [--version] {demo,bench}")
    assert "demo" in result.stdout and "bench" in result.stdout


def test_an_unknown_command_is_a_usage_error() -> None:
    result = _run("train")
    assert result.returncode == 2 and result.stdout == ""
    assert "python -m elastic_batches: error: argument {demo,bench}: invalid choice: 'train'" in result.stderr


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "error: the following arguments are required: {demo,bench}" in capsys.readouterr().err


def test_version_is_the_package_metadatas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert elastic_batches.__version__ == importlib.metadata.version("elastic-batches")
    assert capsys.readouterr().out == f"elastic_batches {elastic_batches.__version__}\n"


def test_demo_help_is_the_demos(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "usage: python -m elastic_batches demo" in capsys.readouterr().out


def test_bench_refuses_an_unknown_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--fast"])
    assert exit_info.value.code == 2
    assert "error: unrecognized arguments: --fast" in capsys.readouterr().err


def test_bench_names_a_missing_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    assert "error: no benchmark script matches ['no_such_benchmark']" in capsys.readouterr().err


@pytest.fixture
def benchmarks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A benchmarks/ folder of three scripts: one meets its target, one misses it, one states none."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    scripts = {
        "fast.py": 'print("table")\nprint(\'{"benchmark": "fast", "case": "a", "target": 1.03, "met": true}\')',
        "slow.py": 'print(\'{"benchmark": "slow", "case": "b", "ratio": 1.2, "target": 1.03, "met": false}\')',
        "plain.py": 'print(\'{"benchmark": "plain", "ratio": 3.0}\')',
    }
    for name, code in scripts.items():
        (folder / name).write_text(code + "\n")
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: folder)
    return folder


def test_bench_check_exits_1_when_a_target_is_missed(benchmarks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--check"]) == 1
    out, err = capsys.readouterr()
    assert "table" in out and "targets: 1 of 2 met" in out
    assert 'missed: slow.py: {"case": "b"} (target 1.03)' in err


def test_bench_without_check_reports_and_exits_0(benchmarks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 0
    assert '"met": false' in capsys.readouterr().out


def test_bench_check_exits_0_when_every_target_is_met(benchmarks: Path) -> None:
    assert cli.main(["bench", "--check", "fast", "plain"]) == 0


def test_bench_exits_1_when_a_script_fails(benchmarks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (benchmarks / "broken.py").write_text("raise SystemExit(3)\n")
    assert cli.main(["bench", "broken"]) == 1
    assert "failed: broken.py" in capsys.readouterr().err
