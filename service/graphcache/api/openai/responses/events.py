"""The stream of /v1/responses: OpenAI's typed events, built from the chat stream's deltas.

The events, each with a `sequence_number` counting from 0, sent as SSE `event: <type>` + `data: <json>`:
  response.created, response.in_progress                       (the response, status "in_progress")
  per output item, in the order the model writes them:
    response.output_item.added                                 (the item, status "in_progress")
    reasoning: response.content_part.added (reasoning_text), response.reasoning_text.delta ...,
               response.reasoning_text.done, response.content_part.done
    message:   response.content_part.added (output_text), response.output_text.delta ...,
               response.output_text.done, response.content_part.done
    function call: response.function_call_arguments.delta ..., response.function_call_arguments.done
    response.output_item.done                                  (the whole item)
  response.completed, or response.incomplete (cut by max_output_tokens), with the whole response
  if the request fails after the stream began: an `error` event, then response.failed (its `error`).
An item is open until the model writes another kind (reasoning, then text, then a call: each closes
the one before) or the answer ends. The chat stream's deltas (api/openai/choices.py's ChatShape) have
the reasoning split off and the calls parsed already, so a streamed answer's items are the whole
answer's, delta by delta; a call is announced only once its name is complete.
"""

from __future__ import annotations

from typing import Any

from graphcache.api.openai.responses.output import (
    call_item,
    message_item,
    new_item_id,
    output_text,
    reasoning_item,
)

__all__ = ["ResponseEvents"]


class _Item:
    """One output item being streamed: its kind, id, index and text so far."""

    def __init__(self, kind: str, index: int, call: dict[str, Any] | None = None) -> None:
        self.kind = kind  # reasoning | message | function_call
        self.index = index
        self.id = new_item_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.text = ""  # reasoning or output text, or a call's arguments
        self.logprobs: list[dict] = []
        self.call = call or {}  # function_call: call_id, name

    def final(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return message_item(self.id, self.text, self.logprobs, status)
        return call_item(self.id, self.call["call_id"], self.call["name"], self.text, status)

    def opened(self) -> dict[str, Any]:
        if self.kind == "message":
            return message_item(self.id, None, status="in_progress")
        if self.kind == "reasoning":
            return reasoning_item(self.id, "", "in_progress")
        return call_item(self.id, self.call["call_id"], self.call["name"], "", "in_progress")


class ResponseEvents:
    """One response's events: feed() each chat delta, finish() once with the whole response object."""

    def __init__(self) -> None:
        self._seq = 0
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # the chat delta's call index -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return out

    def opening(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        out = []
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=item.text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item.kind == "message":
            done = {"content_index": 0, "logprobs": item.logprobs}
            out.append(self.event("response.output_text.done", **where, **done, text=item.text))
            part = output_text(item.text, item.logprobs)
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.call["name"],
                    arguments=item.text,
                )
            )
        out.append(self.event("response.output_item.done", output_index=item.index, item=item.final(status)))
        return out

    def _start(self, kind: str, call: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Open an item of `kind` unless one is open (closing an item of another kind first)."""
        if self._open is not None and self._open.kind == kind and kind != "function_call":
            return []
        out = self._close()
        item = self._open = _Item(kind, len(self.items), call)
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=item.index, item=item.opened()))
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            out.append(
                self.event(
                    "response.content_part.added", **where, part={"type": "reasoning_text", "text": ""}
                )
            )
        elif kind == "message":
            out.append(self.event("response.content_part.added", **where, part=output_text("")))
        return out

    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat stream choice (its `delta` and `logprobs`)."""
        delta = choice.get("delta") or {}
        out: list[dict[str, Any]] = []
        reasoning, content = delta.get("reasoning"), delta.get("content")
        if reasoning:
            out += self._start("reasoning")
            assert self._open is not None
            self._open.text += reasoning
            where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
            out.append(self.event("response.reasoning_text.delta", **where, delta=reasoning))
        if content:
            out += self._start("message")
            assert self._open is not None
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            self._open.text += content
            self._open.logprobs += logprobs
            where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
            out.append(self.event("response.output_text.delta", **where, delta=content, logprobs=logprobs))
        for entry in delta.get("tool_calls") or []:
            fn = entry.get("function") or {}
            if "id" in entry:  # a new call: its id and whole name
                out += self._start("function_call", {"call_id": entry["id"], "name": fn.get("name", "")})
                assert self._open is not None
                self._calls[entry["index"]] = self._open
            item = self._calls.get(entry["index"])
            fragment = fn.get("arguments") or ""
            if item is not None and fragment:
                item.text += fragment
                where = {"item_id": item.id, "output_index": item.index}
                out.append(self.event("response.function_call_arguments.delta", **where, delta=fragment))
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (status "incomplete" when the answer was cut)."""
        return self._close(status)

    def output(self, status: str) -> list[dict[str, Any]]:
        """Every item as it ended: the last one `status`, the others completed."""
        last = len(self.items) - 1
        return [item.final(status if i == last else "completed") for i, item in enumerate(self.items)]

    def closing(self, response: dict[str, Any]) -> dict[str, Any]:
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self.event(kind, response=response)
