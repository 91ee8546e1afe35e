"""Speculative decoding's building blocks: what does not depend on the step seam.

    config.py     --speculative-config (GRAPHCACHE_SPECULATIVE_CONFIG) -> SpeculativeConfig, as vLLM reads it
    proposer.py   the proposer contract: host proposers (token lists) and the seam a model proposer will fill
    ngram.py      NgramProposer: prompt lookup over prompt + output, an incremental per-request index
    build.py      build_proposer: the configured method -> its proposer
    match.py      accept_matching: the verify step's tokens for one-hot drafts (every proposer's), from a draw
                  at each fed position: exact, and a seeded request's tokens are those it gets without
    rejection.py  rejection_sample: speculative sampling for drafts drawn from a distribution (a device
                  proposer's draft_probs, proposer.py); one-hot drafts take match.py's equivalent draw
    payoff.py     StepPayoff: whole steps speculate only where speculating steps measured faster
    metrics.py    SpecDecodeMetrics: vLLM's vllm:spec_decode_* counters

This package sits on the engine's base stage (tests/test_floors.py): it imports no stage (loop, sched,
worker, sample), so each of them may import it. config, proposer, ngram and build import no torch (the
scheduler may call the proposer); only match.py and rejection.py do. Nothing is re-exported here, so importing one
module never loads another's dependencies.
"""
