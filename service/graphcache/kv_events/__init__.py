"""KV cache events as vLLM publishes them (--kv-events-config): what a KV-aware router reads."""
