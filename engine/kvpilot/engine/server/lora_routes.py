"""vLLM's LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and the
adapters' cards in GET /v1/models. The core process applies each between steps
(`lora.runtime`); these routes sit behind the API key like every /v1 route."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from kvpilot.engine.core_process.client import CoreClient, EngineDeadError
from kvpilot.engine.core_process.messages import LoRAAdapterAnswer
from kvpilot.engine.server.errors import OpenAIError
from kvpilot.engine.server.protocol import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


async def _ask(client: CoreClient, op: str, lora_name: str = "",
               lora_path: str = "") -> LoRAAdapterAnswer:
    """Gives the core's answer; raises the OpenAI error of a refusal (param lora_name)."""
    try:
        answer = await client.lora_adapter(op, lora_name, lora_path)
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc), code="engine_dead") from exc
    if answer.status != 200:
        raise OpenAIError(answer.status, answer.message, param="lora_name")
    return answer


async def adapter_cards(client: CoreClient, model_name: str) -> list[ModelCard]:
    """Gives one card per adapter served, its `parent` the base model's name."""
    answer = await _ask(client, "list")
    return [ModelCard(id=name, root=path, parent=model_name)
            for name, path in sorted(answer.adapters.items())]


def add_lora_routes(app: FastAPI, client: CoreClient) -> None:
    """Adds the load and unload routes to `app`."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        """Serves the PEFT adapter at `lora_path` as model `lora_name` (400 names the fix)."""
        await _ask(client, "load", body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        """Stops serving `lora_name`: 404 when not loaded, 400 while requests use it."""
        await _ask(client, "unload", body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
