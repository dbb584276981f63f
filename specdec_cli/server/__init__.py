"""`specdec serve`: an OpenAI-compatible local HTTP server over the speculative engine.

Modules, one responsibility each:
    service  the only contact with the engine: owns the loaded `Session`, tokenizes, streams records, summarizes.
    worker   one thread that serves requests one at a time in arrival order, from a bounded queue.
    errors   the one table mapping exceptions to OpenAI-style error JSON and HTTP status codes.
    schema   the request models (OpenAI's fields) and the response/chunk builders.
    app      the ASGI app (FastAPI + sse-starlette): routes, authentication, server-sent events.

The HTTP stack is an optional extra: `pip install 'specdec[serve]'`.
"""
