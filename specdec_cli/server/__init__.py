"""`specdec serve`: a local HTTP server over the speculative engine, for every API its clients speak.

One internal request, one event stream, a translator per API (STYLE.md, habit 14):
    request   the one internal request (messages or a raw prompt, tools, output format, sampling, limits, prediction).
    reply     the one event stream a reply is rendered from (text, tool-call start/arguments/end, end) and the
              `Writer` protocol a translator implements; `RequestStats`, the numbers every response carries.
    openai_base, openai_chat, openai_completions
              translators: OpenAI's Chat Completions and Completions (wire models in, wire JSON and events out).
    http      answering one request for any translator: submit, wait for the start, JSON or server-sent events.
    service   the only contact with the engine: owns the loaded `Session`, renders prompts, drives generations.
    tools     tool calls: checked schemas, the grammar of a reply under tools, the parser of calls in the reply.
    worker    one thread that serves requests one at a time in arrival order, from a bounded queue.
    errors    the one table mapping exceptions to HTTP status codes and error fields.
    app       the ASGI app (FastAPI + sse-starlette): mounts each translator's routes, authentication, errors.

The HTTP stack is an optional extra: `pip install 'specdec[serve]'`.
"""
