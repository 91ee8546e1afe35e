"""A Responses request as the chat request it runs as: input items -> messages, flat tools -> chat tools,
text.format -> response_format, reasoning.effort -> the template's variables.

Input items, in order, become chat messages:
  - `instructions` first, as a system message;
  - a message item (type "message" or none): its role (user, system, developer, assistant) and its
    text, from a string or input_text / output_text / refusal parts (other parts: a 400, text only);
  - a `reasoning` item: an assistant message's `reasoning_content` (the name Qwen3's and DeepSeek-R1's
    templates render; a template that does not read it leaves it out), from its content, else its
    summary; the assistant message item or function calls after it join that message, so one
    assistant turn is reasoning + text + calls, as a chat completion returned them;
  - a `function_call` item: a call (id = call_id, name, arguments) of the assistant message before
    it, or of a new one;
  - a `function_call_output` item: a role "tool" message answering call_id.
A final assistant message with status "in_progress" or "incomplete" is continued (the prompt ends
inside it, no generation prompt), as vLLM does. Items that point at stored state (item_reference) or
at built-in tools are a 400 naming the item.
"""

from __future__ import annotations

from typing import Any

from graphcache.api.openai.json_limits import JSONShapeError, check_json_value, parse_json_text
from graphcache.api.openai.responses.protocol import FORWARDED_FIELDS, ResponsesRequest
from graphcache.api.openai.tool_calls import FUNCTION_NAME
from graphcache.api.server.errors import clip
from graphcache.engine.errors import InvalidRequest

__all__ = ["chat_fields", "chat_messages", "chat_tool_choice", "chat_tools", "response_format"]

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _text(value: Any, param: str, what: str = "content") -> str:
    """A string, or the text of a list of text parts joined; anything else a 400 naming `param`."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest(f"{what} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(
                f"{param}[{j}]: {kind} parts are not supported (this server serves text only)",
                param=f"{param}[{j}].type",
            )
        else:
            raise InvalidRequest(
                f'{param}[{j}] must be {{"type": "input_text", "text": ...}} (or output_text)',
                param=f"{param}[{j}]",
            )
    return "".join(texts)


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message, when it is an assistant turn that later items of the same turn may join."""
    last = messages[-1] if messages else None
    return last if last is not None and last["role"] == "assistant" else None


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
                for p in parts
            ):
                raise InvalidRequest(
                    f'{param}.{key} must be a list of {{"type": "{kind}", "text": ...}}',
                    param=f"{param}.{key}",
                )
            return "".join(p["text"] for p in parts)
    if item.get("encrypted_content"):
        raise InvalidRequest(
            f"{param}: encrypted reasoning cannot be read here (this server sends reasoning as plain text); "
            "send the item's content, or leave the item out",
            param=f"{param}.encrypted_content",
        )
    return ""


def _call(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{param}.call_id must be a non-empty string", param=f"{param}.call_id")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    if not isinstance(arguments, str):
        raise InvalidRequest(
            f"{param}.arguments must be a JSON object as a string", param=f"{param}.arguments"
        )
    try:
        parsed = parse_json_text(arguments) if arguments.strip() else {}
    except JSONShapeError as e:
        raise InvalidRequest(f"{param}.arguments {e}", param=f"{param}.arguments") from None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequest(
            f"{param}.arguments must be a JSON object (as a string), as the model produced it",
            param=f"{param}.arguments",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_item(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{param} must be an object (an input item)", param=param)
    kind = item.get("type", "message")
    try:
        check_json_value(item)
    except JSONShapeError as e:
        raise InvalidRequest(f"{param} {e}", param=param) from None
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role")
        text = _text(item.get("content"), f"{param}.content")
        turn = _open_assistant(messages)
        if (
            role == "assistant"
            and turn is not None
            and turn["content"] is None
            and not turn.get("tool_calls")
        ):
            turn["content"] = text  # the text after this turn's reasoning
        else:
            messages.append({"role": role, "content": text})
    elif kind == "reasoning":
        messages.append(
            {"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item, param)}
        )
    elif kind == "function_call":
        call = _call(item, param)
        turn = _open_assistant(messages)
        if turn is None:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            turn.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"{param}.call_id must be a non-empty string", param=f"{param}.call_id")
        output = _text(item.get("output"), f"{param}.output", "output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "item_reference":
        raise InvalidRequest(
            f"{param}: item references need stored responses, which this server does not keep; send the item itself",
            param=f"{param}.type",
        )
    else:
        raise InvalidRequest(
            f"{param}: items of type {clip(repr(kind))} are not supported (built-in tools are not served); "
            "send messages, function_call, function_call_output or reasoning items",
            param=f"{param}.type",
        )


def chat_messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], bool]:
    """The chat's messages, and whether the final one is continued (an unfinished assistant message)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages, False
    for i, item in enumerate(body.input):
        _add_item(messages, item, f"input[{i}]")
    last = body.input[-1]
    continued = (
        isinstance(last, dict)
        and last.get("type", "message") == "message"
        and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    )
    return messages, continued


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({"type": "function", "name", "description", "parameters",
    "strict"}) in the chat's nested shape; any other tool type (web_search, file_search, ...) a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}]: only function tools are supported, not {clip(repr(kind))} "
                "(built-in tools such as web_search or file_search are not served)",
                param=f"tools[{i}].type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise InvalidRequest(
                f"tools[{i}].name must match ^[A-Za-z0-9_-]{{1,64}}$, got {clip(repr(name))}",
                param=f"tools[{i}].name",
            )
        fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(
    choice: Any, tools: list[dict[str, Any]] | None
) -> tuple[Any, list[dict[str, Any]] | None]:
    """(the chat's tool_choice, the tools the template shows). {"type": "function", "name"} names one;
    {"type": "allowed_tools", "mode", "tools"} keeps the listed tools and takes the mode."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest('tool_choice must be {"type": "function", "name": ...}', param="tool_choice")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequest(
                'tool_choice must be {"type": "allowed_tools", "mode": "auto" | "required", "tools": [...]}',
                param="tool_choice",
            )
        names = {
            t["name"]
            for t in allowed
            if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
        }
        kept = [t for t in tools or [] if t["function"]["name"] in names]
        if len(kept) != len(allowed):
            raise InvalidRequest(
                'tool_choice.tools must list function tools of tools, as {"type": "function", "name": ...}',
                param="tool_choice.tools",
            )
        return mode, kept
    raise InvalidRequest(
        f'tool_choice must be "none", "auto", "required", a function or allowed_tools, not {clip(repr(kind))} '
        "(built-in tools are not served)",
        param="tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format: json_schema and json_object constrain, text does not."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                'text.format "json_schema" needs a "schema" object', param="text.format.schema"
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(
        'text.format.type must be "text", "json_object" or "json_schema"', param="text.format.type"
    )


def _template_kwargs(body: ResponsesRequest, effort: str | None) -> dict[str, Any] | None:
    """chat_template_kwargs with enable_thinking from reasoning.effort ("none": off; any other: on), as
    vLLM sets it; the client's own chat_template_kwargs win."""
    own = body.chat_template_kwargs
    if effort is None or not (own is None or isinstance(own, dict)):
        return own  # (not an object: the chat request refuses it)
    return {"enable_thinking": effort != "none", **(own or {})}


def chat_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request this Responses request runs as (a dict for ChatCompletionRequest)."""
    messages, continued = chat_messages(body)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(_EFFORTS)}", param="reasoning.effort"
        )
    tools = chat_tools(body.tools)
    tool_choice, tools = chat_tool_choice(body.tool_choice, tools)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "reasoning_effort": effort,
        "chat_template_kwargs": _template_kwargs(body, effort),
        "user": body.user,
        "request_id": body.request_id,
    }
    if continued:
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if body.logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    for name in FORWARDED_FIELDS:
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    return {k: v for k, v in fields.items() if v is not None}
