"""Each closed set of values (backends, policies, modes) is declared once, in graphcache/choices.py: no
other module spells one out again as a Literal or a tuple of strings, and the settings accept exactly
the values the code that acts on them checks."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import graphcache
import graphcache.choices as choices
import pytest
from graphcache.config import Settings
from graphcache.graphs.policy.config import CachePolicyConfig

PACKAGE = Path(graphcache.__file__).parent
SETS = {frozenset(v) for name, v in vars(choices).items() if name.isupper() and isinstance(v, tuple)}


def _string_sets(tree: ast.AST):
    """(line, frozenset of str) for every Literal["a", "b", ...] and tuple/list/set of 2+ str constants."""
    for node in ast.walk(tree):
        elts = None
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            elts = node.elts
        if (
            elts
            and len(elts) >= 2
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts)
        ):
            yield node.lineno, frozenset(e.value for e in elts)


def test_no_module_declares_a_choice_set_again():
    again = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "choices.py" and path.parent == PACKAGE:
            continue
        for line, values in _string_sets(ast.parse(path.read_text())):
            if values in SETS:
                again.append(
                    f"{path.relative_to(PACKAGE)}:{line} {sorted(values)}: import it from graphcache.choices"
                )
    assert not again, "\n".join(again)


def test_the_detector_sees_a_redeclared_set():
    assert {v for _, v in _string_sets(ast.parse('X: Literal["lru", "gdsf"] = "lru"'))} == {
        frozenset({"lru", "gdsf"})
    }
    assert {v for _, v in _string_sets(ast.parse('Y = ("shared", "private")'))} == {
        frozenset({"shared", "private"})
    }


@pytest.mark.parametrize(
    "flat, values",
    [
        ("eviction_policy", choices.EVICTION_POLICIES),
        ("cache_lazy_pool", choices.LAZY_POOLS),
        ("admission", choices.ADMISSION_RULES),
        ("capture_warmup", choices.CAPTURE_WARMUPS),
        ("attention_backend", choices.ATTENTION_BACKENDS),
        ("decode_capture_mode", choices.CAPTURE_MODES),
    ],
)
def test_settings_and_the_code_accept_the_same_values(flat, values):
    field = Settings.flat_fields()[flat]
    assert typing.get_args(field.annotation) == values
    for value in values:  # every value the settings accept, the policy config takes too
        Settings(**{flat: value}, device="cpu")
    with pytest.raises(ValueError):
        Settings(**{flat: "nonsense"}, device="cpu")


def test_the_policy_config_refuses_what_the_settings_refuse():
    for name in ("admission", "eviction_policy", "lazy_pool", "capture_warmup"):
        with pytest.raises(ValueError, match=name):
            CachePolicyConfig(max_entries=1, max_bytes=1, **{name: "nonsense"})
