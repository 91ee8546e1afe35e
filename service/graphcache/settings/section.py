"""SettingsSection, the base of every section, and the parsers for values given as text (env, flags).

A field annotated with CommaList takes `1,2,4` as well as JSON; BlankIsUnset reads a blank value as unset;
PathText keeps a path as its text.
"""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, BeforeValidator, ConfigDict

__all__ = ["BlankIsUnset", "CommaList", "PathText", "SettingsSection"]


def _list_text(v: object) -> object:
    """A list from env or a flag as text: `1,2,4` (comma-separated) or JSON (`[1,2,4]`, `null`); "" = []."""
    if not isinstance(v, str):
        return v
    text = v.strip()
    if text.startswith("[") or text == "null":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError("a list is comma-separated (1,2,4) or a JSON list ([1,2,4])") from None
    return [item.strip() for item in text.split(",") if item.strip()]


def _blank_is_unset(v: object) -> object:
    # GRAPHCACHE_MODEL="" (a blank Helm or compose value) means "not set", never Path(".").
    return None if isinstance(v, str) and not v.strip() else v


def _path_text(v: object) -> object:
    # A directory given as a Path (tests, Settings(model=tmp_path)) is kept as its text; a hub id is text.
    return os.fspath(v) if isinstance(v, os.PathLike) else v


CommaList = BeforeValidator(_list_text)
BlankIsUnset = BeforeValidator(_blank_is_unset)
PathText = BeforeValidator(_path_text)


class SettingsSection(BaseModel):
    """One owner's settings. populate_by_name: a section can be built by field name as well as by flat name;
    hide_input_in_errors: a refused secret is never printed by a ValidationError's str()."""

    model_config = ConfigDict(populate_by_name=True, hide_input_in_errors=True, extra="forbid")
