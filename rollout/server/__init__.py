"""The engine as an HTTP server: OpenAI-compatible and SGLang-native APIs over one engine loop.

    miles-serve --model builtin:k3-tiny-arith            # or: python -m rollout.server --model DIR ...
    curl localhost:30000/generate -d '{"text": "12+3=", "sampling_params": {"temperature": 0}}'

Requests from every connection are batched together by the engine's continuous batching: one thread
(`engine_loop`) owns the engine and steps it while there is work; the asyncio side submits, aborts and
receives tokens through it. A client that disconnects aborts its samples; past `--max-queued` waiting
samples, requests get 429 instead of memory.

    __main__.py      miles-serve: flags (ServeConfig's fields) -> load -> serve until SIGINT/SIGTERM
    config.py        EngineFlags (the engine flags miles-k3 generate shares) and ServeConfig: defaults, checks
    loading.py       tokenizer, tower + processor, and the Engine of the flags' EngineSpec (rollout.build)
    tokenization.py  prompts, chat templates, incremental decoding
    images.py        chat messages' content parts; image_url parts and image_data (data URLs only) -> the
                     checkpoint's ProcessedImages + ids
    engine_loop.py   EngineLoop: the one thread that calls the engine
    generation.py    GenerationService: n samples, stop strings, text, admission (the in-process client)
    protocol.py      request-body checks that name the field, error bodies, SSE, ServerContext
    responses.py     JSON and event-stream answers that abort on client disconnect
    openai_api.py    /v1/models, /v1/completions, /v1/chat/completions (supported fields: its docstring)
    sglang_api.py    /generate, /health, /health_generate, /get_model_info, /abort_request (same)
    control_api.py   SGLang's RL control API (adapters, memory, pause / continue, flush, weight version,
                     /get_server_info, /metrics; its docstring)
    app.py           the Starlette app and Server (uvicorn in the main thread or a background one)
"""
