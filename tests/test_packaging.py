"""Packaging by metadata: the `kvpilot` wheel (operator, router, CLI) needs no torch.

The wheel is built from the repository, its declared dependencies are resolved through the
metadata of what the test environment has installed, and it is installed into an empty
virtual environment that sees only those dependencies. There `kvpilot operator --help`
and `kvpilot route --help` must run and `import torch` must fail. Offline: nothing is
downloaded, the dependencies are the test environment's own files.
"""

from __future__ import annotations

import email
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"torch", "triton"}

pytestmark = pytest.mark.slow


def _build(project: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(project)],
                   check=True, capture_output=True, text=True, timeout=300)
    return next(out.glob("*.whl"))


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(name))
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Gives every installed distribution the requirements pull in (no extras), by name."""
    env = {**default_environment(), "extra": ""}
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        found[name] = dist = metadata.distribution(name)
        todo.extend(Requirement(r) for r in dist.requires or [])
    return found


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return {"kvpilot": _build(ROOT, out / "kvpilot"),
            "kvpilot-engine": _build(ROOT / "engine", out / "engine"),
            "kvpilot-kernels": _build(ROOT / "kernels", out / "kernels")}


def test_control_plane_metadata_pulls_no_torch(wheels: dict[str, Path]) -> None:
    closure = _closure(_requires(wheels["kvpilot"]))
    assert {"kopf", "pydantic", "fastapi"} <= set(closure)
    assert not GPU_ONLY & set(closure), sorted(closure)


def test_engine_metadata_lists_torch_and_the_other_two(wheels: dict[str, Path]) -> None:
    names = {canonicalize_name(r.name) for r in _requires(wheels["kvpilot-engine"])}
    assert {"torch", "kvpilot", "kvpilot-kernels"} <= names
    assert "torch" in {canonicalize_name(r.name) for r in _requires(wheels["kvpilot-kernels"])}


def test_wheels_split_the_engine_namespace(wheels: dict[str, Path]) -> None:
    """The contracts and the router ship in `kvpilot`; the rest of kvpilot.engine in the engine."""
    def files(name: str) -> set[str]:
        with zipfile.ZipFile(wheels[name]) as zf:
            return {n for n in zf.namelist() if n.startswith("kvpilot/")}

    control, engine = files("kvpilot"), files("kvpilot-engine")
    assert "kvpilot/engine/contracts/args.py" in control
    assert "kvpilot/engine/router/app.py" in control
    assert "kvpilot/engine/engine_loop/llm_engine.py" in engine
    assert "kvpilot/engine/contracts/assets/tiny-tokenizer.json" in control
    assert not control & engine
    assert not any(n.startswith("kvpilot/engine/") and "/contracts/" not in n
                   and "/router/" not in n for n in control)


def test_operator_and_router_run_without_torch(wheels: dict[str, Path], tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies: links to the test environment's files of exactly the closure.
    deps = tmp_path / "deps"
    deps.mkdir()
    for dist in _closure(_requires(wheels["kvpilot"])).values():
        for file in dist.files or []:
            top = file.parts[0]
            target = Path(str(dist.locate_file(top)))
            if top.startswith("..") or not target.exists() or (deps / top).exists():
                continue
            (deps / top).symlink_to(target)
    (site / "deps.pth").write_text(f"{deps}\n")
    with zipfile.ZipFile(wheels["kvpilot"]) as zf:
        zf.extractall(site)
    launcher = ("import sys; sys.argv[0] = 'kvpilot'\n"
                "from kvpilot.cli.main import main\nsys.exit(main())\n")
    for argv in (["operator", "--help"], ["route", "--help"], ["crds"]):
        done = subprocess.run([str(python), "-c", launcher, *argv], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
    # The router's --tokenizer (the operator renders it for built-in models) needs no torch.
    tokenize = ("from kvpilot.engine.contracts.tokenizer import load_tokenizer\n"
                "assert load_tokenizer('tiny-llama').encode('hello')\n")
    done = subprocess.run([str(python), "-c", tokenize], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr
