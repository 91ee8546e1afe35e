"""HttpSettings (`settings.http`): the HTTP server, who may call it and what it accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from graphcache.choices import ReasoningParserName, ToolCallParserName
from graphcache.settings.section import BlankIsUnset, CommaList, SettingsSection

__all__ = ["HttpSettings"]


def _is_ascii_token(v: str) -> bool:
    # HTTP header values are Latin-1 on the wire; curl and most clients send a non-ASCII token as UTF-8
    # bytes, so such a token would match only clients that happen to encode it as the server decodes it.
    return v.isascii() and v.isprintable() and v == v.strip()


class HttpSettings(SettingsSection):
    """The HTTP server and what it accepts: the api floor and `graphcache serve`."""

    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 in containers.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port).")
    admin_token: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="Bearer token for /admin/* (printable ASCII, e.g. from `openssl rand -hex 32`). Unset: "
        "admin is off, unless admin_allow_loopback lets loopback clients in.",
    )
    api_key: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="API keys for /v1/*, /tokenize and /detokenize (clients send 'Authorization: Bearer "
        "<key>'): one, or several comma-separated; printable ASCII, e.g. from `openssl rand -hex 32`. "
        "Unset: that API is open. /health, /ready, /ping, /version and /metrics are always open.",
    )
    admin_allow_loopback: bool = Field(
        False, description="Without a token, allow /admin/* from 127.0.0.1/::1."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish."
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; bigger gets 413.")
    max_header_bytes: int = Field(
        64 << 10,
        ge=1024,
        alias="http_max_header_bytes",
        description="Largest request head (request line + "
        "headers); a bigger one is answered 431 (httptools) or 400 (h11) and the connection closed.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        alias="http_header_timeout_s",
        description="Seconds a connection may take to send a complete "
        "request head (and an idle keep-alive connection stays open); slower ones are closed, so half-open "
        "connections cannot pile up.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        alias="http_body_timeout_s",
        description="Seconds a request body may take to arrive after its head; a slower one gets 408 and "
        "its connection is closed, so clients trickling bodies cannot hold connections. Raise it with "
        "max_body_bytes for big bodies over slow links (the default takes 1 MiB at ~35 KB/s).",
    )
    slow_grace_s: float = Field(
        2.0,
        gt=0,
        alias="http_slow_grace_s",
        description="A connection still sending a request head or body this many seconds into it is "
        "slow, and counts against http_max_slow_per_client.",
    )
    max_slow_per_client: int = Field(
        32,
        ge=1,
        alias="http_max_slow_per_client",
        description="Slow connections one client (peer IP; an IPv6 /64) may hold; one more that turns "
        "slow is closed (408 in its body). Behind a proxy or NAT every client has its address: keep "
        "the proxy buffering request bodies (nginx does by default), or raise this toward "
        "http_max_connections (which turns the bound off) at the price of one client holding more.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        alias="http_max_connections",
        description="Open connections at most; past it a new connection takes the place of the one "
        "waiting longest on its client (a head, body or next request not arriving), and is closed "
        "when every one is being answered; requests past it get 503. Keep it below the process's "
        "file-descriptor limit (`ulimit -n`).",
    )
    cors_origins: Annotated[list[str], CommaList] = Field(
        default_factory=list, description="CORS allowed origins; empty = CORS off."
    )
    allow_special_tokens_in_chat: bool = Field(
        False,
        description="Encode special-token strings inside chat message content as control tokens. Off: "
        "content is always plain text, so a user cannot open a fake system turn (set only for trusted clients).",
    )
    json_disable_any_whitespace: bool = Field(
        False,
        description="JSON output (response_format, guided_json, structured_outputs json) without whitespace "
        "outside strings, unless a request's structured_outputs.disable_any_whitespace says otherwise (vLLM's "
        "option): a weak model cannot spend its tokens on runs of blanks.",
    )
    tool_call_parser: ToolCallParserName = Field(
        "hermes",
        description='How chat answers are read back into tool_calls (and what tool_choice "required" or a '
        "named function forces): hermes (<tool_call> blocks: Qwen, Hermes), llama3_json (JSON calls, "
        "optionally after <|python_tag|>: Llama 3.1-3.3), mistral ([TOOL_CALLS] [...]). Match the model's chat template.",
    )
    reasoning_parser: ReasoningParserName = Field(
        "none",
        description="Split a chat answer's <think>...</think> into reasoning (and reasoning_content): "
        "deepseek_r1 (the template opens <think>, so text before </think> is reasoning) or qwen3 (as vLLM's: "
        "with thinking on, the answer starts inside the reasoning, whether the prompt or the model wrote "
        "<think>; thinking off, as enable_thinking false sets it, is all content); none keeps all text in content.",
    )

    chat_template: Annotated[str | None, BlankIsUnset] = Field(
        None,
        description="The chat template for every chat request without its own: a file path (.jinja) "
        "or the jinja template itself. Unset: the model's (chat_template.jinja or tokenizer_config.json, "
        "else ChatML).",
    )

    trust_request_chat_template: bool = Field(
        False,
        description="Accept a chat request's own jinja template (chat_template, or chat_template_kwargs"
        ".chat_template). Off: such requests get 400, as vLLM's default (a template is code the server runs).",
    )
    chat_template_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest a chat template may take to render one chat; past it the rendering process "
        "is killed and the request gets 400.",
    )
    chat_template_memory_mb: int = Field(
        512,
        ge=64,
        description="Address space of each chat-template rendering process (MB); a render past it gets 400.",
    )
    chat_template_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="Chat-template rendering processes for the model's template (and as many again, "
        "started on first use, for request templates when trust_request_chat_template is on).",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_or_file(cls, v: str | None) -> str | None:
        # A value without jinja markers names a file: a typo is refused at start, not on the first chat
        # (one that does not compile is refused when the engine loads: Tokenizer.check_chat_template).
        if v is not None and "{" not in v and not Path(v).expanduser().is_file():
            raise ValueError(f"{v!r} is not a readable file (nor a jinja template); fix the path")
        return v

    @field_validator("admin_token")
    @classmethod
    def _ascii_token(cls, v: str | None) -> str | None:
        # Refused at start, without echoing the secret.
        if v is not None and not _is_ascii_token(v):
            raise ValueError(
                "admin_token must be printable ASCII without leading or trailing spaces (HTTP "
                "header values are Latin-1 on the wire, and clients send other characters "
                "differently): use ASCII characters, e.g. a hex token from `openssl rand -hex 32`"
            )
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_keys(cls, v: object) -> list[str] | None:
        # GRAPHCACHE_API_KEY=k1,k2 or --api-key k1,k2: one key or several, comma-separated. NoDecode and no
        # JSON here: any ASCII key (even "null" or "[1]") is taken as written.
        if isinstance(v, str):
            v = v.split(",")
        if v is None:
            return None
        if not isinstance(v, list | tuple) or not all(isinstance(k, str) for k in v):
            raise ValueError(
                "api_key must be one key or several comma-separated keys of printable ASCII text"
            )
        keys = [k.strip() for k in v if k.strip()]
        if not keys:
            # Set, but blank (GRAPHCACHE_API_KEY="", " " or ","): an open API nobody asked for. Refused at
            # start rather than served open without a word.
            raise ValueError(
                "api_key is set but holds no key (blank, or only commas and spaces): set a key, "
                "e.g. from `openssl rand -hex 32`, or unset GRAPHCACHE_API_KEY (--api-key) to leave "
                "the API open"
            )
        if not all(_is_ascii_token(key) for key in keys):
            raise ValueError(
                "api_key must be printable ASCII (HTTP header values are Latin-1 on the wire, "
                "and clients send other characters differently): use ASCII characters, e.g. "
                "a hex key from `openssl rand -hex 32`"
            )
        return keys
