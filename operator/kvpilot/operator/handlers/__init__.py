"""kopf handlers: thin shells that read objects, call the pure renderers, apply, and write status.

Importing a handler module registers its handlers with kopf's default
registry. `HANDLER_MODULES` is the one list `kvpilot operator` imports; other
parts of the operator (e.g. the autoscaler) add their module here.
"""

from __future__ import annotations

import importlib

HANDLER_MODULES = [
    "kvpilot.operator.handlers.lifecycle",
    "kvpilot.operator.handlers.indexes",
    "kvpilot.operator.handlers.inference_model",
    "kvpilot.operator.handlers.pools",
    "kvpilot.operator.handlers.rollup",
    "kvpilot.operator.handlers.pods",
    "kvpilot.operator.autoscale.handler",
]


def register() -> None:
    """Imports every handler module so its handlers are in kopf's default registry."""
    for name in HANDLER_MODULES:
        importlib.import_module(name)
