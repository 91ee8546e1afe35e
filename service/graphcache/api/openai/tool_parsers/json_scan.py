"""Reading one JSON object of a tool call as the model writes it: validated a piece at a time, without
recursion, with the position of each top-level member's value in the text read so far.

The tool-call parsers (hermes.py, llama3_json.py, mistral.py) hand a call object's text to a
`JsonObjectScanner` as it arrives. The scanner says when the object closed (`done`), when the text
stopped being JSON (`error`: a syntax error, a duplicate top-level key, or nesting deeper than
MAX_JSON_DEPTH), and where the value of, say, "name" or "arguments" starts and ends, so that a call's
name is read only once its string is closed and its arguments are sent as the model's own text.
"""

from __future__ import annotations

import json
import re

from graphcache.api.openai.json_limits import MAX_JSON_DEPTH, JSONShapeError, parse_json_text

__all__ = ["CallObject", "JsonObjectScanner", "ScannedObject", "decode_arguments_string"]

_WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')  # what ends a run of plain string characters
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class JsonObjectScanner:
    """One JSON object, from its "{", fed in pieces. `text` is what was read of it; `members` maps each
    top-level key to [start, end] of its value in `text` (end None while the value is still open)."""

    def __init__(self, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.text = ""
        self.members: dict[str, list[int | None]] = {}
        self.done = False
        self.error = False
        self._max_depth = max_depth
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = "value"
        self._key: str | None = None  # the top-level member whose value is being read
        self._str_start = 0
        self._str_is_key = False
        self._left = 0  # hex digits of a \u escape still to come
        self._word = ""  # the literal being read (true, false, null) ...
        self._word_at = 0  # ... and how much of it was read
        self._num_start = 0

    def feed(self, piece: str) -> int:
        """Read what of `piece` belongs to the object: returns how many characters that was. Fewer than
        len(piece) only once the object closed (done) or the text is not JSON (error; the offending
        character is not counted)."""
        if self.done or self.error:
            return 0
        start = len(self.text)
        text, self.text = self.text, ""
        text += piece  # the only reference: CPython grows the string in place (no copy per piece)
        i, n = start, len(text)
        while i < n and not self.done and not self.error:
            i = self._step(text, i)
        self.text = text[:i]
        return i - start

    # --- one step of the state machine: returns the next position --------------------------------
    def _step(self, text: str, i: int) -> int:
        state, c = self._state, text[i]
        if state == "string":
            m = _STRING_STOP.search(text, i)
            if m is None:
                return len(text)
            j, stop = m.start(), m.group()
            if stop == '"':
                self._end_string(text, j + 1)
                return j + 1
            if stop == "\\":
                self._state = "escape"
                return j + 1
            return self._fail(j)  # a raw control character
        if state == "escape":
            if c not in _ESCAPES:
                return self._fail(i)
            self._state, self._left = ("unicode", 4) if c == "u" else ("string", 0)
            return i + 1
        if state == "unicode":
            if c not in _HEX:
                return self._fail(i)
            self._left -= 1
            if not self._left:
                self._state = "string"
            return i + 1
        if state == "number":
            if c in _NUMBER_CHARS:
                return i + 1
            if not _NUMBER.fullmatch(text, self._num_start, i):
                return self._fail(i)
            self._end_value(i)
            return i
        if state == "literal":
            if c != self._word[self._word_at]:
                return self._fail(i)
            self._word_at += 1
            if self._word_at == len(self._word):
                self._end_value(i + 1)
            return i + 1
        if c in _WS:
            return i + 1
        if state == "value":
            return self._value(c, i)
        if state == "key_or_end" and c == "}" or state == "after" and c in "}]":
            return self._close(c, i)
        if state in ("key_or_end", "key"):
            if c != '"':
                return self._fail(i)
            self._str_start, self._str_is_key, self._state = i, True, "string"
            return i + 1
        if state == "colon":
            if c != ":":
                return self._fail(i)
            self._state = "value"
            return i + 1
        if state == "after":
            if c != ",":
                return self._fail(i)
            self._state = "key" if self._stack[-1] == "{" else "value"
            return i + 1
        if state == "value_or_end":
            if c == "]":
                return self._close(c, i)
            self._state = "value"
            return i
        return self._fail(i)  # pragma: no cover - every state is handled above

    def _value(self, c: str, i: int) -> int:
        if not self._stack and c != "{":
            return self._fail(i)
        if len(self._stack) == 1 and self._key is not None:
            self.members[self._key][0] = i
        if c in "{[":
            self._stack.append(c)
            if len(self._stack) > self._max_depth:
                return self._fail(i)
            self._state = "key_or_end" if c == "{" else "value_or_end"
        elif c == '"':
            self._str_start, self._str_is_key, self._state = i, False, "string"
        elif c == "-" or c.isdigit() and c.isascii():
            self._num_start, self._state = i, "number"
        elif c in _LITERALS:
            self._word, self._word_at, self._state = _LITERALS[c], 1, "literal"
        else:
            return self._fail(i)
        return i + 1

    def _close(self, c: str, i: int) -> int:
        if (self._stack[-1] == "{") != (c == "}"):
            return self._fail(i)
        self._stack.pop()
        if not self._stack:
            self.done = True
        else:
            self._end_value(i + 1)
        return i + 1

    def _end_string(self, text: str, end: int) -> None:
        if not self._str_is_key:
            self._end_value(end)
            return
        self._state = "colon"
        if len(self._stack) != 1:
            return
        key = json.loads(text[self._str_start : end])
        if key in self.members:  # a second value for a key: which one the model meant is unclear
            self._fail(end)
            return
        self._key = key
        self.members[key] = [None, None]

    def _end_value(self, end: int) -> None:
        self._state = "after"
        if len(self._stack) == 1 and self._key is not None:
            self.members[self._key][1] = end

    def _fail(self, i: int) -> int:
        self.error = True
        return i


def decode_arguments_string(raw: str) -> str | None:
    """Arguments given as a JSON string holding the arguments object (Granite 4 writes them so): the
    string's text, or None when it does not hold a JSON object (within MAX_JSON_DEPTH)."""
    text = json.loads(raw)
    try:
        value = parse_json_text(text)
    except (ValueError, JSONShapeError):
        return None
    return text if isinstance(value, dict) else None


class ScannedObject:
    """A JSON object read a piece at a time by its JsonObjectScanner: what every call reader over one
    object answers the same way (its text so far, and whether it is complete or broken)."""

    def __init__(self) -> None:
        self.scan = JsonObjectScanner()

    def feed(self, piece: str) -> int:
        return self.scan.feed(piece)

    @property
    def text(self) -> str:
        return self.scan.text

    @property
    def done(self) -> bool:
        return self.scan.done

    @property
    def broken(self) -> bool:
        return self.scan.error


class CallObject(ScannedObject):
    """A call object {"name": ..., "arguments" (or "parameters"): {...}} read as it arrives, in any key
    order. Its name counts once its string is closed; its arguments are the model's own text of the
    arguments object (a JSON string holding the object is read as that object's text)."""

    def __init__(self) -> None:
        super().__init__()
        self._string_args: str | None = None

    def name(self) -> str | None:
        span = self.scan.members.get("name")
        if span is None or span[0] is None or span[1] is None or self.scan.text[span[0]] != '"':
            return None
        return json.loads(self.scan.text[span[0] : span[1]]) or None

    def _args_span(self) -> list[int | None] | None:
        for key, span in self.scan.members.items():
            if key in ("arguments", "parameters"):
                return span if span[0] is not None else None
        return None

    def arguments(self) -> str | None:
        """The arguments text read so far (complete once the object is), or None: not there yet, or
        not arguments (a string arguments value counts once it is complete and holds an object)."""
        span = self._args_span()
        if span is None:
            return None
        start, end = span[0], span[1]
        assert start is not None
        first = self.scan.text[start]
        if first == "{":
            return self.scan.text[start : len(self.scan.text) if end is None else end]
        if first == '"' and end is not None:
            if self._string_args is None:
                self._string_args = decode_arguments_string(self.scan.text[start:end]) or ""
            return self._string_args or None
        return None

    def arguments_since(self, sent: int) -> str:
        """What the arguments text has past its first `sent` characters (no copy of the rest)."""
        span = self._args_span()
        if span is None or span[0] is None or self.scan.text[span[0]] != "{":
            return (self.arguments() or "")[sent:]
        end = span[1] if span[1] is not None else len(self.scan.text)
        return self.scan.text[span[0] + sent : end]

    def ready(self) -> bool:
        """The call may be announced: its name is complete and its arguments have begun as an object
        (the character after "{" is read and valid) or are a complete string holding one."""
        if self.broken or self.name() is None:
            return False
        args = self.arguments()
        return args is not None and (args[0] != "{" or bool(args[1:].strip()))
