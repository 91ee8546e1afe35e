"""Chat templates: loading a configured one, compiling it the way transformers does, rendering a chat
with it, and the errors a client's chat can cause. No torch, no tokenizer: the API process imports it.

Templates render with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, `strftime_now`), so a model's own template produces the same prompt as HF.
A template that refuses the messages (`raise_exception`, or a template error on them) raises
`ChatTemplateError`: a client error. A chat may bring its own template (`compile_client_template`:
compiled in the same sandbox and cached by its text; one that does not compile raises
`InvalidChatTemplate`), and may continue its final message (`continue_final_message`: the prompt ends
inside that message, as transformers' option does).

Kept apart from model/tokenizer.py because rendering is text -> text: the Tokenizer renders through
these functions and then encodes, while the API needs only the errors and `load_chat_template`.
jinja2 is imported on first use: only chats need it.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "MAX_TEMPLATE_MESSAGE_CHARS",
    "ChatTemplateError",
    "InvalidChatTemplate",
    "TemplateLimitError",
    "compile_chat_template",
    "compile_client_template",
    "load_chat_template",
    "normalize_chat",
    "render_chat",
    "set_text_limit",
]

# A chat template's own error message, as the client sees it (one line, at most this long).
MAX_TEMPLATE_MESSAGE_CHARS = 300

# Used when tokenizer_config.json has no chat_template: ChatML, the most common plain format.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused these messages (its `raise_exception`, or it failed on them): the
    client's messages are the cause, so this is a 400 carrying `message` (one line, bounded)."""

    def __init__(self, message: str) -> None:
        message = " ".join(str(message).split()) or "the chat template refused these messages"
        if len(message) > MAX_TEMPLATE_MESSAGE_CHARS:
            message = message[: MAX_TEMPLATE_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.message = message


class InvalidChatTemplate(ChatTemplateError):
    """A template given with the chat (not the model's own) does not compile: the template is the cause."""


class _TemplateRaised(Exception):
    """A template's own `raise_exception(message)`."""

    def __init__(self, message: Any) -> None:
        super().__init__(str(message))
        self.message = str(message)


def load_chat_template(value: str) -> str:
    """A configured chat template: the text of the file `value` names, else `value` itself when it
    reads as jinja (holds "{{" or "{%"). Anything else is a path that does not exist: ValueError naming it."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a readable file nor a jinja template; fix the path")


# The sandbox refuses an operator whose result would pass these sizes before computing it: a 169-byte
# template can ask for `7 ** 10000000` (seconds of one uninterruptible C call) or `'a' * 10**8`
# (hundreds of MB). Integers past INT_BITS_LIMIT bits cannot even be printed (Python's 4,300-digit
# limit is about 14,000 bits). Text and sequences are bounded by the render's size limit
# (`set_text_limit`), which the caller sets from the context window; DEFAULT_TEXT_LIMIT until then.
INT_BITS_LIMIT = 8192
DEFAULT_TEXT_LIMIT = 1 << 22


# The widths and precisions of %-format fields ("%08d", "%.3f", "%-20s").
_FORMAT_FIELD = re.compile(r"%[-+ #0]*\d*(?:\.\d+)?")


class TemplateLimitError(Exception):
    """A template asked for a result past one of the sandbox's size limits."""


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _make_environment() -> type:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, plus size checks on the operators that grow results
        multiplicatively (`*`, `**`) or by doubling (`+` on text or lists in a loop)."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})
        text_limit = DEFAULT_TEXT_LIMIT

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * abs(left).bit_length() > INT_BITS_LIMIT:
                    raise TemplateLimitError(f"`**` would give an integer past {INT_BITS_LIMIT} bits")
            elif operator == "*":
                self._check_product(left, right)
            elif operator == "%" and isinstance(left, str):
                widths = [int(n) for field in _FORMAT_FIELD.findall(left) for n in re.findall(r"\d+", field)]
                if widths and max(widths) > self.text_limit:
                    raise TemplateLimitError(f"`%` would format a field past {self.text_limit} characters")
            elif operator == "+":
                a, b = _length(left), _length(right)
                if a is not None and b is not None and a + b > self.text_limit:
                    raise TemplateLimitError(f"`+` would build a value past {self.text_limit} items")
            return super().call_binop(context, operator, left, right)

        def _check_product(self, left: Any, right: Any) -> None:
            if isinstance(left, int) and isinstance(right, int):
                if abs(left).bit_length() + abs(right).bit_length() > INT_BITS_LIMIT:
                    raise TemplateLimitError(f"`*` would give an integer past {INT_BITS_LIMIT} bits")
                return
            for seq, count in ((left, right), (right, left)):
                size = _length(seq)
                if size is not None and isinstance(count, int) and size * count > self.text_limit:
                    raise TemplateLimitError(f"`*` would build a value past {self.text_limit} items")

    return BoundedSandbox


def set_text_limit(compiled: jinja2.Template, limit: int) -> None:
    """The size bound (characters, list items) the template's operators may build up to."""
    compiled.environment.text_limit = limit  # type: ignore[attr-defined]


def compile_chat_template(source: str) -> jinja2.Template:
    """The model's own template, compiled in transformers' sandbox (with the size checks above). A
    template that does not compile is a server problem: jinja2's TemplateSyntaxError, as it is."""
    try:
        from jinja2.ext import loopcontrols
    except ImportError as e:  # pragma: no cover - jinja2 ships with transformers and the server deps
        raise RuntimeError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message: str):
        raise _TemplateRaised(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators=None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = _make_environment()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@functools.lru_cache(maxsize=16)
def _compile_cached(source: str) -> jinja2.Template:
    """Chats' own templates, compiled once per distinct text (clients resend the same one)."""
    return compile_chat_template(source)


def compile_client_template(source: str) -> jinja2.Template:
    """A template sent with the chat (not the model's own), compiled once per distinct text. One that
    does not compile is the client's: InvalidChatTemplate."""
    import jinja2

    try:
        return _compile_cached(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidChatTemplate(f"chat_template does not compile: {e} (line {e.lineno})") from None
    except RecursionError:  # thousands of nested blocks overflow the parser
        raise InvalidChatTemplate("chat_template does not compile: it nests too deeply") from None
    except MemoryError:  # the caller's limit (render_worker.py names it)
        raise
    except Exception as e:
        raise InvalidChatTemplate(f"chat_template does not compile: {type(e).__name__}: {e}") from None


def render_chat(
    compiled: jinja2.Template,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    **variables: Any,
) -> str:
    """The prompt text of `messages` (normalized by `normalize_chat` first) under `compiled`;
    `variables` (bos_token, tools, ...) reach the template as they are. Raises ChatTemplateError when
    the template refuses the messages (`raise_exception`, any error while rendering them, or a
    sandbox size limit). continue_final_message: the text stops right after the final message's content."""
    messages = normalize_chat(messages)
    try:
        rendered = compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(e.message) from None
    except TemplateLimitError as e:
        raise ChatTemplateError(f"the chat template passed a size limit: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except MemoryError:  # the caller's limit (render_worker.py names it)
        raise
    except Exception as e:  # undefined attributes, sandbox refusals, 1/0, type errors in filters
        raise ChatTemplateError(f"the chat template failed on these messages: {_describe(e)}") from None
    return _cut_after_final(rendered, messages) if continue_final_message else rendered


def _describe(e: Exception) -> str:
    """A template error as the client sees it: jinja's own errors by message, others by type too."""
    import jinja2

    return str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"


def normalize_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: an assistant message's `tool_calls[i].function.arguments`
    as a dict (OpenAI sends a JSON string; Qwen/Hermes templates render it with `tojson`). Tool
    messages ({"role": "tool", "content", "tool_call_id"}) pass as they are. Raises ChatTemplateError
    for arguments that are not a JSON object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for i, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(fn, dict) and isinstance(args, str):  # (a str args implies a dict fn)
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        args = None
                    if not isinstance(args, dict):
                        raise ChatTemplateError(
                            f"tool_calls[{i}].function.arguments must be a JSON object "
                            "(as a string), as the model produced it"
                        )
                    call = {**call, "function": {**fn, "arguments": args}}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _cut_after_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` up to the end of the final message's content (its last occurrence: the template may
    repeat it earlier, never after). Templates that strip content are matched on the stripped text."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    for text in (content, content.strip()):
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    raise ChatTemplateError("the chat template does not render the final message's content as sent")
