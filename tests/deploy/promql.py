"""Metric names referenced by PromQL expressions, and the names a /metrics page exposes."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

# PromQL keywords and functions that look like identifiers; a metric name never follows `(` directly
# in our expressions without being a selector, so names are taken as identifiers not followed by `(`
# and not inside a label matcher or a string.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
    "le",
    "atan2",
    "start",
    "end",
}


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (Grafana's $variables stripped first)."""
    e = re.sub(r"\$\{?\w+\}?", "1", expr)
    e = _STRING.sub('""', e)
    e = _MATCHERS.sub("", e)
    e = _GROUPING.sub("", e)
    e = _RANGE.sub("", e)
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group(1)
        if word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def exposed_sample_names(exposition: str) -> set[str]:
    """Every sample name on a /metrics page: counters with `_total`, histograms `_bucket/_sum/_count`."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            names.add(sample.name)
    return names
