"""The OpenAI-compatible surface: routes, request bodies, sampling, answers, tools, parsers."""
