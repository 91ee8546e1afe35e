"""Depth bounds a constraint must meet before the grammar library sees it.

llguidance converts schemas and compiles grammars recursively in native code: a schema whose `$ref`s
chain a thousand deep, or a Lark/GBNF grammar of thousands of chained rules (`r0: r1`, `r1: r2`, ...),
recurses once per link. The compile threads have a big stack (engine/sample/grammar_compiler.py), so that
cannot kill the server; these checks refuse such inputs first, with a message naming the bound, so
they cost no compile at all. All walks here are iterative: they cannot overflow the Python stack.

depth of a JSON schema: its JSON nesting, and the longest chain of local `$ref`s (a chain that comes
back to a schema already on it is recursion, which the library handles: it ends the chain).
depth of a grammar: the longest chain of rule references (recursion ends a chain likewise).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["grammar_depth", "json_nesting_depth", "ref_chain_depth"]


def json_nesting_depth(value: Any) -> int:
    """Levels of objects and arrays in a parsed JSON value (a scalar is 0)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _refs_under(node: Any) -> set[str]:
    """Every `$ref` string in the subtree of `node`."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.add(ref)
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))
    return found


def _resolve(root: Any, ref: str) -> Any:
    """The node a local ref ("#", "#/$defs/a", "#/properties/x/items") points at, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ref_chain_depth(schema: Any, limit: int | None = None) -> int:
    """The longest chain of local `$ref`s a schema resolves through (0 without refs); with `limit`, any
    value over it as soon as one chain is longer (the walk stops there)."""
    edges: dict[str, set[str]] = {}
    todo = list(_refs_under(schema))
    while todo:
        ref = todo.pop()
        if ref in edges:
            continue
        target = _resolve(schema, ref)
        edges[ref] = _refs_under(target) if target is not None else set()
        todo.extend(r for r in edges[ref] if r not in edges)
    return _longest_chain(edges, _refs_under(schema), limit)


def _longest_chain(edges: dict[str, set[str]], starts: set[str], limit: int | None = None) -> int:
    """Nodes on the longest path from any start; an edge back onto the current path (recursion) ends it.
    With `limit`: returns the first path length over it, once the walk finds one."""
    best: dict[str, int] = {}
    for start in starts:
        if start in best:
            continue
        on_path = {start}
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                best[node] = 1 + max(
                    (best.get(c, 0) for c in edges.get(node, ()) if c not in on_path), default=0
                )
                continue
            if child in on_path or child in best:
                continue
            on_path.add(child)
            stack.append((child, iter(sorted(edges.get(child, ())))))
            if limit is not None and len(stack) > limit:
                return len(stack)
    return max((best.get(s, 0) for s in starts), default=0)


# A rule's head at the start of a line: Lark `name:`, `?name:`, `name.2:`; GBNF `name ::=`.
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)
# What cannot hold a rule reference: string literals, regexes, comments.
_NOT_REFERENCES = re.compile(
    r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/(?:\\.|[^/\\\n])+/[imsx]*'
    r"|//[^\n]*|#[^\n]*"
)
_WORD = re.compile(r"[A-Za-z_][\w-]*")


def grammar_depth(text: str, limit: int | None = None) -> int:
    """The longest chain of rule references in a Lark or GBNF grammar (approximate: it reads rule heads
    and the words of their bodies, not the full syntax, so it can only over-count a chain). `limit` as for
    ref_chain_depth."""
    heads = list(_RULE_HEAD.finditer(text))
    names = {m.group(1) for m in heads}
    edges: dict[str, set[str]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = _NOT_REFERENCES.sub(" ", text[head.end() : end])
        edges.setdefault(head.group(1), set()).update(w for w in _WORD.findall(body) if w in names)
    return _longest_chain(edges, set(edges), limit)
