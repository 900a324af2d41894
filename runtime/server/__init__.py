"""`flashgen serve`: OpenAI's HTTP API over the decoder's engine (routes, request schema, the engine's
thread, incremental detokenizing)."""
