"""LoggingSettings (`settings.logging`): how every process of the server logs."""

from __future__ import annotations

from pydantic import Field

from graphcache.choices import LogFormat, LogLevel
from graphcache.settings.section import SettingsSection

__all__ = ["LoggingSettings"]


class LoggingSettings(SettingsSection):
    """How the server logs: set up once per process (server, engine process, tensor-parallel ranks)."""

    log_format: LogFormat = Field("text", description="text for people, json for log pipelines.")
    log_level: LogLevel = Field("info", description="Root log level.")
