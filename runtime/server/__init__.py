"""``runtime.server``: the OpenAI-compatible HTTP server over the engine."""
