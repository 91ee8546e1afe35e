"""Shared helper for API tests whose requests must be answered before the engine is reached."""

from __future__ import annotations


class EngineNotNeeded:
    """Stands in for the engine where validation, routing or an auth gate must answer first: any
    attribute beyond the few the app reads at startup fails the test."""

    alive = ready = True
    model_name = "test"
    max_model_len = 64
    metrics = None

    def __getattr__(self, name):
        raise AssertionError(f"the engine was reached ({name}) for a request that should be refused")
