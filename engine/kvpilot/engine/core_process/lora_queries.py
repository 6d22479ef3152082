"""Applies a `LoRAAdapterQuery` (load, unload, list) to the engine in the core process,
between steps, and gives its answer with the HTTP status the API server returns."""

from __future__ import annotations

from kvpilot.engine.core_process.messages import LoRAAdapterAnswer, LoRAAdapterQuery
from kvpilot.engine.engine_loop.engine_core import LoRAServing, ServedEngine

LORA_OPS = ("load", "unload", "list")


def lora_adapter_answer(engine: ServedEngine, query: LoRAAdapterQuery) -> LoRAAdapterAnswer:
    """Gives the answer to `query`: 200, 400 (refused: the message names the fix) or 404
    (unload of an adapter that is not loaded)."""
    if not isinstance(engine, LoRAServing):
        return LoRAAdapterAnswer(query.query_id, 400, "lora_name: this engine serves no LoRA "
                                 "adapters (a disaggregated role or a test engine)", {})
    try:
        if query.op == "load":
            engine.load_lora_adapter(query.lora_name, query.lora_path)
        elif query.op == "unload":
            engine.unload_lora_adapter(query.lora_name)
        elif query.op != "list":
            raise ValueError(f"op={query.op!r} is invalid: choose one of {', '.join(LORA_OPS)}")
    except KeyError:
        return LoRAAdapterAnswer(query.query_id, 404, f"lora_name={query.lora_name!r} is not "
                                 "loaded: GET /v1/models lists the adapters", {})
    except ValueError as exc:
        return LoRAAdapterAnswer(query.query_id, 400, str(exc), {})
    return LoRAAdapterAnswer(query.query_id, 200, "", engine.lora_adapters())
