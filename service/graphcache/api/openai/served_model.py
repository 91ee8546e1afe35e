"""The engine and model a request is served by, and GET /v1/models' cards.

`serving_engine` is the engine if it may take a request now (else the 503 saying why),
`generating_engine` the same for a generation endpoint (an embedding model answers it with a 400), and
`check_model` the served model's or a LoRA adapter's name (another is a 404 `model_not_found`).
`model_cards` / `model_card` are OpenAI's model objects, with vLLM's fields.
"""

from __future__ import annotations

from fastapi import Request

from graphcache.api.server.errors import APIError, api_error_for


def serving_engine(request: Request):
    """The engine, if it may take a request now; else the 503 that says why."""
    engine = request.app.state.engine
    refused = engine.refusal()
    if refused is not None:
        raise api_error_for(refused)
    return engine


def generating_engine(request: Request, endpoint: str):
    """serving_engine for a generation endpoint: an embedding model answers it with a 400 naming the flag (vLLM
    answers that the model does not support the API)."""
    engine = serving_engine(request)
    if getattr(engine, "embedding", None) is not None:
        raise APIError(
            400,
            f"The model '{engine.model_name}' is served as an embedding model and answers /v1/embeddings, not "
            f"{endpoint}; serve a generation model, or this checkpoint with --runner generate.",
            param="model",
        )
    return engine


def check_model(engine, name: str | None) -> str:
    """The served model's name, or a LoRA adapter's (--enable-lora); another name is a 404
    `model_not_found`, as OpenAI and vLLM answer."""
    adapters = engine.lora_modules
    if adapters is not None and name is not None and name in adapters:
        return name
    if name is not None and name != engine.model_name:  # the caller's name is not echoed back
        raise APIError(
            404,
            f"The requested model does not exist; this server serves '{engine.model_name}' (GET /v1/models).",
            param="model",
            code="model_not_found",
            type="invalid_request_error",
        )
    return engine.model_name


def model_cards(request: Request) -> list[dict]:
    """GET /v1/models' entries: the served model, then its LoRA adapters (--enable-lora)."""
    engine = request.app.state.engine
    cards = [model_card(request)]
    if engine.lora_modules is not None:
        for adapter in engine.lora_modules.all():
            parent = adapter.base_model_name or engine.model_name
            cards.append(model_card(request, adapter.name, adapter.path, parent))
    return cards


def model_card(request: Request, model_id: str | None = None, root: str | None = None, parent=None) -> dict:
    """The served model (or an adapter of it: its id, path and base model) as OpenAI's model object."""
    engine = request.app.state.engine
    created = request.app.state.started
    model_id = model_id or engine.model_name
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "graphcache",
        # vLLM's card: root is the checkpoint served (the model id where no path is configured), parent
        # the base model of an adapter (None for the base model), permission one open ModelPermission.
        "root": root or str(request.app.state.settings.model.path or engine.model_name),
        "parent": parent,
        "max_model_len": engine.max_model_len if engine.ready else None,
        # The sampling defaults a request gets for the fields it leaves out (--generation-config: the
        # model's generation_config.json by default); {} = the API's own; null until the model is loaded.
        "generation_defaults": dict(engine.generation_defaults) if engine.ready else None,
        "permission": [
            {
                "id": f"modelperm-{model_id}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
