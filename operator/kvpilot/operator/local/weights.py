"""Where a local fleet's engines read their weights: `kvpilot up` downloads and mounts nothing.

A `dummy:` source needs no files. Every other source is a volume of the pod (an init
container's Hub download, a claim, an image) that a local process does not have, so the
pods' `--model /models/...` would name a directory that is not there. `kvpilot up` refuses
such a source before it starts anything, with the command that puts the weights in a
directory and the flag (`--model-dir DIR`) that serves them from there; the manifest stays
the one the cluster runs.
"""

from __future__ import annotations

import shlex

from kvpilot.operator.api.common import ModelSource
from kvpilot.operator.render.weights import fetch_request
from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE

MODEL_DIR_FLAG = "--model-dir"


def fetch_command(model: ModelSource) -> str:
    """Gives the `kvpilot fetch ... --local-dir DIR` line that downloads an hf:// source as
    its pods would (revision and filters only where the manifest sets them)."""
    request = fetch_request(model)
    args = ["kvpilot", "fetch", request.repo]
    if request.revision:
        args += ["--revision", request.revision]
    if request.include != DEFAULT_INCLUDE:
        args += ["--include", *request.include]
    if request.exclude != DEFAULT_EXCLUDE:
        args += ["--exclude", *request.exclude]
    return f"{shlex.join(args)} --local-dir DIR"


def local_model_dir(model: ModelSource, model_dir: str | None) -> str | None:
    """Gives the directory every engine serves the weights from (None: a built-in config).

    Raises ValueError naming spec.model.source and the fix when the source needs files that
    `--model-dir` does not provide, or `--model-dir` is given for a built-in config.
    """
    source = model.source
    if source.startswith("dummy:"):
        if model_dir is not None:
            raise ValueError(f"{MODEL_DIR_FLAG} {model_dir}: spec.model.source={source!r} is a "
                             "built-in config with random weights and reads no files; remove "
                             f"{MODEL_DIR_FLAG}, or set spec.model.source to the weights' "
                             "hf://, pvc:// or oci:// source")
        return None
    if model_dir is not None:
        return model_dir
    if source.startswith("hf://"):
        how = (f"kvpilot up downloads nothing (a pod's init container does): run "
               f"`{fetch_command(model)}`")
    elif source.startswith("pvc://"):
        how = ("kvpilot up mounts no PersistentVolumeClaim: copy the weights on the claim's "
               "path to a directory DIR")
    else:
        how = ("kvpilot up pulls no image volume: copy the image's /models directory to a "
               "directory DIR")
    raise ValueError(f"spec.model.source={source!r}: {how}, then add {MODEL_DIR_FLAG} DIR to "
                     "this kvpilot up command (the manifest stays as the cluster runs it)")
