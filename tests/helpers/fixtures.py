"""Session-scoped pytest fixtures over `checkpoints.py`; import them into a conftest.py:

    from helpers.fixtures import tiny_checkpoints  # noqa: F401

`tiny_checkpoints(family)` writes a family's checkpoint on first use and gives its dir
(families: see checkpoints.FAMILIES; mixtral is sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.checkpoints import FAMILIES, write_checkpoint

# Sharded so that the index-file path of the loader is covered by the parity tests.
SHARDED = {"mixtral": "200KB"}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Gives a function family -> checkpoint dir, writing each family once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in FAMILIES:
            raise KeyError(f"family={family!r} is unknown: choose one of {', '.join(FAMILIES)}")
        if family not in written:
            written[family] = write_checkpoint(root, family,
                                               max_shard_size=SHARDED.get(family))
        return written[family]

    return get
