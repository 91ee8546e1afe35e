"""graphcache: a graph-caching LLM inference microservice."""
