"""The sections of graphcache.config.Settings, one module per owner of the values.

Each section is a pydantic model that goes whole to the code that reads it (`settings.engine` to the
engine, `settings.graph_cache` to the graph cache); section.py holds their common base and the parsers of
values given as text. graphcache.config.Settings puts the sections together behind flat GRAPHCACHE_* names.
"""
