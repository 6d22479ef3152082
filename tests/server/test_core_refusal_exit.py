"""An engine core that refuses to start exits quietly: the launcher's SIGTERM, which follows the
refusal, used to land in the core's exit handlers (torch's finalizers) and print a traceback
under the one-line refusal (`kvpilot serve tiny-llama --device cuda` on a CPU host, about one
run in three)."""

from __future__ import annotations

import time
import weakref

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.core_process.launch import CoreProcess, CoreStartError

REFUSAL = "device='cuda' but no CUDA GPU is visible: use --device cpu"


class _Library:
    """Stands in for torch's op libraries, finalised (slowly) when the interpreter exits."""


LIBRARIES: list[_Library] = []


def refuse_then_exit_slowly(engine_args: EngineArgs, host: str, http_port: int) -> None:
    """Refuses, leaving a finaliser as slow as torch's to run when the process ends."""
    LIBRARIES.append(_Library())
    weakref.finalize(LIBRARIES[-1], time.sleep, 2.0)
    raise ValueError(REFUSAL)


def test_a_refused_core_exits_without_a_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    core = CoreProcess.start(EngineArgs(model="tiny-llama"), "127.0.0.1", 0, "warning",
                             refuse_then_exit_slowly)
    with pytest.raises(CoreStartError, match="no CUDA GPU") as refused:
        core.wait_ready(120)
    assert refused.value.refused
    core.stop()  # SIGTERM while the core runs its exit handlers
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert core.process.exitcode == 2
