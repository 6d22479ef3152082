"""The foundation's promises: import names, a torch-free control plane and CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_import_names_from_repository_root() -> None:
    # `operator/` at the root must not shadow the standard library module.
    result = _run("import collections, operator, kvpilot.operator, kvpilot.engine, kvpilot.kernels;"
                  "print(operator.__file__)")
    assert result.returncode == 0, result.stderr
    assert "lib" in result.stdout and "site-packages" not in result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["operator", "--help"], ["crds", "--help"],
                                  ["route", "--help"], ["up", "--help"], ["sim", "--help"],
                                  ["bench", "--help"], ["bench", "throughput", "--help"],
                                  ["bench", "latency", "--help"], ["serve", "--help"]])
def test_cli_help_leaves_torch_unloaded(argv: list[str]) -> None:
    code = (
        "import sys, contextlib, io\n"
        "import kvpilot.operator\n"
        "from kvpilot.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), exc.code\n"
        "assert 'usage: kvpilot' in buf.getvalue(), buf.getvalue()\n"
        "print('torch' in sys.modules)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_operator_package_never_imports_torch() -> None:
    code = (
        "import sys, pkgutil, importlib\n"
        "import kvpilot.operator as op\n"
        "for m in pkgutil.walk_packages(op.__path__, 'kvpilot.operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('torch' in sys.modules)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_console_script_installed() -> None:
    kvpilot = Path(sys.executable).parent / "kvpilot"
    result = subprocess.run([str(kvpilot), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for name in ("serve", "route", "up", "operator", "crds", "bench", "sim"):
        assert name in result.stdout
