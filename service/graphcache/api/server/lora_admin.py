"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded at runtime, as
vLLM serves them under VLLM_ALLOW_RUNTIME_LORA_UPDATING (bodies {"lora_name", "lora_path"} and
{"lora_name"}; answers the plain text "Success: LoRA adapter 'NAME' added successfully." / "... removed
successfully.", errors as OpenAI error bodies: 400 for a name already loaded or a bad adapter, 404 for an
unload of a name not loaded).

Behind the admin token (api/server/admin.py's require_admin: these change what the server serves), and off
unless the server runs with --enable-lora and allow_runtime_lora_updating (404 naming both otherwise). The
engine reads and checks the adapter on its thread first (engine/loop/lora_admin.py); only then does the
API list the name, so no request can name an adapter that is not there yet.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from graphcache.api.openai.body import RequestBody, SBool, Text
from graphcache.api.server.admin import require_admin
from graphcache.api.server.errors import APIError, api_error_for
from graphcache.engine.lora_modules import LoraModule, check_lora_name

__all__ = ["LoadLoraAdapterRequest", "UnloadLoraAdapterRequest", "router"]

router = APIRouter(prefix="/v1", tags=["lora"], dependencies=[Depends(require_admin)])


class LoadLoraAdapterRequest(RequestBody):
    lora_name: Text = Field(..., max_length=256, description="The model name requests will use.")
    lora_path: Text = Field(..., max_length=4096, description="The PEFT directory, or a hub id.")
    load_inplace: SBool = Field(False, description="vLLM's: replace a loaded adapter of that name (refused).")


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: Text = Field(..., max_length=256)
    lora_int_id: int | None = Field(None, description="vLLM's; unused (names identify adapters here).")


def _lora_engine(request: Request):
    settings = request.app.state.settings
    if not (settings.lora.enable_lora and settings.lora.allow_runtime_lora_updating):
        raise APIError(
            404,
            "Runtime LoRA updates are off: start the server with --enable-lora and "
            "GRAPHCACHE_ALLOW_RUNTIME_LORA_UPDATING=true (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).",
            code="not_found",
        )
    engine = request.app.state.engine
    refused = engine.refusal(admin=True)
    if refused is not None:
        raise api_error_for(refused)
    return engine


def _answer(status: int, message: str, param: str) -> PlainTextResponse:
    if status != 200:
        code = "not_found" if status == 404 else "invalid_request"
        raise APIError(status, message, param=param, code=code)
    return PlainTextResponse(message)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    engine = _lora_engine(request)
    try:
        name = check_lora_name(body.lora_name)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name") from None
    if body.load_inplace:
        raise APIError(
            400, "load_inplace is not supported; unload the adapter, then load it", param="load_inplace"
        )
    if name == engine.model_name or name in engine.lora_modules:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    status, message = await engine.load_lora_adapter(name, body.lora_path)
    if status == 200:
        engine.lora_modules.add(LoraModule(name, body.lora_path))
    return _answer(status, message, "lora_path" if status == 400 else "lora_name")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    engine = _lora_engine(request)
    engine.lora_modules.remove(body.lora_name)  # no new request may name it from now on
    status, message = await engine.unload_lora_adapter(body.lora_name)
    return _answer(status, message, "lora_name")
