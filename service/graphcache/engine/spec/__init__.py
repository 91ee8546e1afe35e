"""Speculative decoding's building blocks: what does not depend on the step seam.

    config.py     --speculative-config (GRAPHCACHE_SPECULATIVE_CONFIG) -> SpeculativeConfig, as vLLM reads it
    proposer.py   the proposer contract: host proposers (token lists) and the seam a model proposer will fill
    ngram.py      NgramProposer: prompt lookup over prompt + output, an incremental per-request index
    build.py      build_proposer: the configured method -> its proposer
    rejection.py  rejection_sample: exact speculative sampling on the device, greedy rows as plain greedy
    metrics.py    SpecDecodeMetrics: vLLM's vllm:spec_decode_* counters

This package sits on the engine's base stage (tests/test_floors.py): it imports no stage (loop, sched,
worker, sample), so each of them may import it. config, proposer, ngram and build import no torch (the
scheduler may call the proposer); only rejection.py does. Nothing is re-exported here, so importing one
module never loads another's dependencies.
"""
