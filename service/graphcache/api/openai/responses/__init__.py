"""OpenAI's Responses API (POST /v1/responses), its stateless subset, served through the chat path.

protocol.py (the body) -> conversion.py (a chat request: messages, tools, constraints) -> the chat
pipeline of api/openai/routes.py -> output.py (the whole `response` object) or events.py (the stream
of typed events); route.py wires them.
"""
