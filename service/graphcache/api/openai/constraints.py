"""Structured-output fields of a generation request, parsed into output constraints.

A request may constrain its output through OpenAI's `response_format`, vLLM's older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, or vLLM's newer `structured_outputs` object; at
most one of them may be set. Each becomes (param, kind, value): `param` is the field the client set
(for the 400 and the compile error), kind/value as engine/sequence.py's StructuredSpec
(json | json_schema | regex | choice | grammar). A JSON schema travels as JSON text. Compiling the
constraint (is the regex valid, is the schema supported) is engine/sample/structured.py's.

`structured_outputs.disable_any_whitespace` (vLLM's option) asks for compact JSON: no whitespace outside
strings, whichever field set the JSON constraint (vLLM applies it to response_format's too); absent, the
server's json_disable_any_whitespace setting decides.
"""

from __future__ import annotations

import json
from typing import Any

from graphcache.engine.errors import InvalidRequest

__all__ = ["JSON_KINDS", "disable_any_whitespace", "structured_constraints"]

# The constraint kinds whose output is JSON: compact applies to them only.
JSON_KINDS = ("json", "json_schema")
# structured_outputs keys that set options of the constraint rather than being one.
_OPTIONS = ("disable_any_whitespace",)


def structured_constraints(
    *,
    response_format: dict[str, Any] | None,
    guided_json: str | dict[str, Any] | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
    structured_outputs: dict[str, Any] | None,
) -> list[tuple[str, str, Any]]:
    """The output constraints these fields ask for, as (param, kind, value), at most one (else InvalidRequest)."""
    found: list[tuple[str, str, Any]] = []
    rf = response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", "json", None))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise InvalidRequest(
                    'response_format type "json_schema" needs "json_schema": {"name", "schema"}',
                    param="response_format",
                )
            schema = spec.get("schema")
            found.append(
                ("response_format", "json", None)
                if schema is None
                else ("response_format", "json_schema", _schema_text(schema, "response_format"))
            )
        elif kind != "text":
            raise InvalidRequest(
                'response_format type must be "text", "json_object" or "json_schema"', param="response_format"
            )
    if guided_json is not None:
        found.append(("guided_json", "json_schema", _schema_text(guided_json, "guided_json")))
    if guided_regex is not None:
        found.append(("guided_regex", "regex", guided_regex))
    if guided_choice is not None:
        found.append(("guided_choice", "choice", tuple(guided_choice)))
    if guided_grammar is not None:
        found.append(("guided_grammar", "grammar", guided_grammar))
    if structured_outputs is not None:
        found += _structured_outputs(structured_outputs)
    if len(found) > 1:
        raise InvalidRequest(
            "only one output constraint per request: " + ", ".join(p for p, _, _ in found), param=found[1][0]
        )
    return found


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or a string holding one) as a JSON string."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise InvalidRequest("the JSON schema is not valid JSON", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("the JSON schema must be an object", param=param)
        return json.dumps(schema)
    except RecursionError:  # the engine's depth bound (grammar_max_depth) is far below this
        raise InvalidRequest("the JSON schema is nested too deeply; flatten it", param=param) from None


_STRUCTURED_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json",
}


def disable_any_whitespace(structured_outputs: dict[str, Any] | None) -> bool | None:
    """The request's own choice of compact JSON (structured_outputs.disable_any_whitespace), None if unset."""
    value = (structured_outputs or {}).get("disable_any_whitespace")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(
            "disable_any_whitespace must be true or false", param="structured_outputs.disable_any_whitespace"
        )
    return value


def _structured_outputs(so: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """vLLM's `structured_outputs` object: json | regex | choice | grammar | json_object, and the
    disable_any_whitespace option (disable_any_whitespace() reads it)."""
    found = []
    disable_any_whitespace(so)
    for key, value in so.items():
        param = f"structured_outputs.{key}" if key.isidentifier() else "structured_outputs"
        if value is None or value is False or key in _OPTIONS:
            continue
        if key not in _STRUCTURED_KINDS:
            raise InvalidRequest(
                f"structured_outputs supports {', '.join([*_STRUCTURED_KINDS, *_OPTIONS])} only", param=param
            )
        kind = _STRUCTURED_KINDS[key]
        if kind == "json_schema":
            value = _schema_text(value, param)
        elif kind == "json":
            if value is not True:
                raise InvalidRequest("json_object must be true or false", param=param)
            value = None
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequest("choice must be a non-empty list of strings", param=param)
            value = tuple(value)
        elif not isinstance(value, str) or not value:
            raise InvalidRequest(f"{key} must be a non-empty string", param=param)
        found.append(("structured_outputs", kind, value))
    return found
