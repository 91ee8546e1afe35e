"""build_proposer: the configured method -> the proposer the engine drafts with."""

from __future__ import annotations

from graphcache.engine.spec.config import SpeculativeConfig
from graphcache.engine.spec.ngram import NgramProposer
from graphcache.engine.spec.proposer import Proposer

__all__ = ["build_proposer"]


def build_proposer(config: SpeculativeConfig, max_model_len: int | None = None) -> Proposer:
    """A host proposer for `config`. method draft_model needs a DeviceProposer (proposer.py), not built
    yet: it is refused here (and by serve's preflight, before anything loads), with the way out."""
    if config.method == "ngram":
        return NgramProposer.from_config(config, max_model_len)
    raise NotImplementedError(
        f"speculative_config.method {config.method!r}: the draft-model proposer is not built yet; "
        'use "method": "ngram" for now, or leave --speculative-config unset'
    )
