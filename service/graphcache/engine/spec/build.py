"""build_proposer: the configured method -> the proposer the engine drafts with."""

from __future__ import annotations

from graphcache.engine.spec.config import SpeculativeConfig
from graphcache.engine.spec.ngram import NgramProposer
from graphcache.engine.spec.proposer import Proposer

__all__ = ["build_proposer"]


def build_proposer(config: SpeculativeConfig, max_model_len: int | None = None) -> Proposer:
    """The proposer for `config` that needs nothing but the config (n-gram). method draft_model loads a
    model beside the target's: the engine builds it (engine/worker/draft_model.py: build_draft_proposer)
    and hands it to EngineCore; reaching here with it is a wiring mistake, named as such."""
    if config.method == "ngram":
        return NgramProposer.from_config(config, max_model_len)
    raise NotImplementedError(
        f"speculative_config.method {config.method!r}: the draft-model proposer is built beside the model "
        "runner (engine/worker/draft_model.py build_draft_proposer) and passed as EngineCore(..., "
        "proposer=...); the Engine does this, a hand-built EngineCore must too"
    )
