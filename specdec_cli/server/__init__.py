"""`specdec serve`: a local HTTP server over the speculative engine, for every API its clients speak.

One internal request, one event stream, a translator per API (STYLE.md, habit 14):
    request   the one internal request (messages or a raw prompt, tools, output format, sampling, limits, prediction).
    reply     the one event stream a reply is rendered from (text, tool-call start/arguments/end, end) and the
              `Writer` protocol a translator implements; `RequestStats`, the numbers every response carries.
    openai_base, openai_chat, openai_completions, openai_responses, anthropic_messages, llama_infill
              translators: OpenAI's Chat Completions, Completions and Responses, Anthropic's Messages, llama.cpp's
              /infill (wire models in, wire JSON and events out; Responses also holds recent responses for
              previous_response_id).
    fields    which request field informs and which changes what must come back (docs/server.md's table).
    fim       fill-in-the-middle prompts with the model's FIM tokens (llama-server's layout, repo-level).
    http      answering one request for any translator: submit, wait for the start, JSON or server-sent events.
    service   the only contact with the engine: owns the loaded `Session`, renders prompts, drives generations.
    tools     tool calls: checked schemas, and the Hermes `<tool_call>` format's grammar and reply parser.
    custom_tools
              custom tools (free-form input held to a Lark or regex grammar): the grammar as a regex on the call's
              `input` string, the call's input decoded as it streams.
    tool_formats
              the tool-call format of each template family (Hermes, Llama 3, Mistral, Phi-4, generic JSON):
              detected from the chat template; how it renders tools and history, its grammar, its parser.
    guards    loop guards: no reply repeats a tool call (of its own, or the last turn's answered ones).
    worker    the one thread that owns the model: a bounded queue (its status: /health, Retry-After), each request
              placed on a slot, and the loop that runs `lanes.Scheduler.step`.
    lanes     slots (sequences of one context) and the scheduler that plans each pass's rows.
    jobs      a submitted request: its program on a slot, the events it delivers, its log line.
    saver     when what was learnt is saved while the server runs.
    errors    the one table mapping exceptions to HTTP status codes and error fields.
    app       the ASGI app (FastAPI + sse-starlette): mounts each translator's routes, authentication, errors.

The HTTP stack is an optional extra: `pip install 'specdec-cli[serve]'`.
"""
