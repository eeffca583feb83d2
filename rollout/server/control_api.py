"""SGLang's RL control API, with SGLang's routes, fields and answers (`io_struct.py`, `http_server.py`), so a
framework that drives an SGLang rollout server (slime's, Miles', verl's SGLang clients) drives this one:

    POST /load_lora_adapter                {lora_name, lora_path, pinned, lora_id}: a PEFT directory, as the
                                           trainer saves it (`miles_k3.model.peft`), into a free slot
    POST /load_lora_adapter_from_tensors   {lora_name, config_dict, serialized_tensors, load_format, pinned,
                                           added_tokens_config, lora_id}: the same adapter sent in the body
                                           (encoding below)
    POST /unload_lora_adapter              {lora_name, lora_id}: its slot freed, its cached prefixes dropped
        each answers SGLang's LoRAUpdateOutput {success, error_message, loaded_adapters}, 400 on failure
    POST /release_memory_occupation        {tags}: the KV pages and KDA slots (and the prefix cache, CUDA
                                           graphs) given back; "weights" is accepted and keeps the frozen
                                           base resident. Requests sent meanwhile wait for the resume
    POST /resume_memory_occupation         {tags}
    POST /pause_generation                 {mode}: "abort" (SGLang's default: every request in flight finishes
                                           with finish_reason abort), "in_place" (they stay, pages and all) or
                                           "retract" (they are retracted, their pages and slots back in the
                                           pools, and wait outside the engine: the cache can be flushed and
                                           the memory released meanwhile); any way no step runs until
                                           /continue_generation
    POST /continue_generation              {torch_empty_cache}: retracted requests go on from their tokens
                                           (ahead of those sent during the pause)
    GET|POST /flush_cache                  every cached prefix evicted; 400 while requests are in flight
    POST /update_weight_version            {new_version, abort_all_requests}: the version every meta_info
                                           reports from then on
    GET  /get_weight_version
    GET  /get_server_info                  the server's settings, pool occupancy (KV pages, KDA slots used /
                                           total), running / waiting counts and the prefix-cache hit rate
    GET  /metrics                          the same counts as Prometheus text (SGLang's metric names where it
                                           has one, `miles_k3:` ones for the pools)

`/abort_request` ({rid} or {abort_all}) lives with /generate (`rollout.server.sglang_api`): the requests it
hits finish with finish_reason abort, never a 5xx.

Tensor encoding of /load_lora_adapter_from_tensors: SGLang's `serialized_tensors` is its multiprocessing
serializer's output (pickled CUDA IPC handles), which only a process on the same host may load and which
would unpickle what the body sends. Here it is the base64 of a safetensors file holding the adapter's tensors
under the names a PEFT `adapter_model.safetensors` has, with `config_dict` its `adapter_config.json`
(`load_format` null or "safetensors"): the directory /load_lora_adapter reads, sent in one body. Every state
change runs on the engine's thread between two steps, through the engine's own methods (which a sharded
engine replays on its ranks, `Engine.REPLAYED`).
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout.engine import Engine
from rollout.server.generation import RequestError
from rollout.server.loading import load_adapter
from rollout.server.protocol import Fields, ServerContext, error_body, parse_body
from rollout.server.responses import json_error, read_body

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
PAUSE_MODES = ("abort", "in_place", "retract")


async def _fields(request: Request) -> Fields:
    raw = await read_body(request)
    return Fields(parse_body(raw) if raw.strip() else {})


def _lora_answer(ctx: ServerContext, error: str | None = None, status: int = 400) -> JSONResponse:
    """SGLang's LoRAUpdateOutput; a failure also carries our `error` object (the field it names)."""
    body: dict[str, Any] = {
        "success": error is None,
        "error_message": error,
        "loaded_adapters": {name: ctx.adapter_paths.get(name, name) for name in ctx.adapters},
    }
    if error is not None:
        body.update(error_body(RequestError(error, status, param="lora_name")))
    return JSONResponse(body, status_code=200 if error is None else status)


def _lora_name(f: Fields, ctx: ServerContext) -> str:
    name = f.required("lora_name")
    if not isinstance(name, str) or not name:
        raise f.fail("lora_name", "must be a non-empty string")
    return name


async def _add_adapter(ctx: ServerContext, name: str, path: Path, shown: str) -> JSONResponse:
    """Read the PEFT directory `path` (checked against the served model) and load it as `name` into the pool
    (`rollout.server.loading.load_adapter`: a lower rank padded; refusals name the flag that bounds the pool)."""
    if name == ctx.model_name or name in ctx.adapters:
        return _lora_answer(ctx, f"lora_name {name!r} is already served; unload it first")
    try:
        await ctx.service.loop.call(lambda engine: load_adapter(engine, name, path))
    except (ValueError, OSError) as e:
        return _lora_answer(ctx, f"lora {name!r} ({shown}): {e}")
    ctx.adapters = (*ctx.adapters, name)
    ctx.adapter_paths[name] = shown
    return _lora_answer(ctx)


async def load_lora_adapter(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        name = _lora_name(f, ctx)
        path = f.required("lora_path")
        if not isinstance(path, str) or not path:
            raise f.fail("lora_path", "must be a PEFT adapter directory")
        f.bool("pinned", False)
        f.str("lora_id", None)
        f.finish()
    except RequestError as e:
        return json_error(e)
    if not Path(path).is_dir():
        return _lora_answer(ctx, f"lora_path {path!r}: no such directory")
    return await _add_adapter(ctx, name, Path(path), path)


async def load_lora_adapter_from_tensors(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        name = _lora_name(f, ctx)
        config = f.required("config_dict")
        if not isinstance(config, dict):
            raise f.fail("config_dict", "must be an object (the adapter's adapter_config.json)")
        data = f.required("serialized_tensors")
        fmt = f.str("load_format", None)
        if fmt not in (None, "safetensors"):
            raise f.fail("load_format", "must be null or 'safetensors' (base64 of a safetensors file)")
        if not isinstance(data, str):
            raise f.fail("serialized_tensors", "must be a base64 string of a safetensors file")
        try:
            blob = base64.b64decode(data, validate=True)
        except ValueError:
            raise f.fail("serialized_tensors", "is not base64 (of a safetensors file)") from None
        f.bool("pinned", False)
        f.str("lora_id", None)
        f.neutral("added_tokens_config")
        f.finish()
    except RequestError as e:
        return json_error(e)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "adapter_config.json").write_text(json.dumps(config))
        (d / "adapter_model.safetensors").write_bytes(blob)
        return await _add_adapter(ctx, name, d, "__tensor__")


async def unload_lora_adapter(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        name = _lora_name(f, ctx)
        f.str("lora_id", None)
        f.finish()
    except RequestError as e:
        return json_error(e)
    if name not in ctx.adapters:
        return _lora_answer(ctx, f"lora_name {name!r} is not loaded; loaded: {list(ctx.adapters)}", status=404)
    loop = ctx.service.loop

    def unload(engine: Engine) -> None:
        if name in loop.parked_adapters():  # the engine sees its own queues only
            raise RuntimeError(f"requests using {name!r} are retracted by a pause; continue or abort them first")
        engine.remove_adapter(name)

    try:
        await loop.call(unload)
    except (ValueError, RuntimeError) as e:
        return _lora_answer(ctx, f"lora {name!r}: {e}")
    ctx.adapters = tuple(a for a in ctx.adapters if a != name)
    ctx.adapter_paths.pop(name, None)
    return _lora_answer(ctx)


def _tags(f: Fields) -> tuple[str, ...]:
    tags = f.raw("tags", list(MEMORY_TAGS))
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise f.fail("tags", f"must be a list of {list(MEMORY_TAGS)}")
    return tuple(tags)


async def _memory(request: Request, release: bool):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        tags = _tags(f)
        f.finish()
    except RequestError as e:
        return json_error(e)
    if not {"kv_cache", "cuda_graph"} & set(tags):
        return Response(status_code=200)  # the weights stay resident: nothing to do

    def run(engine: Engine) -> None:
        if release:
            if engine.kv is not None:
                engine.release_memory()
        else:
            engine.resume_memory()

    try:
        await ctx.service.loop.call(run)
    except RuntimeError as e:
        why = f"{e} (pause_generation with mode abort, or abort_request, ends them)" if release else str(e)
        return json_error(RequestError(why, status=400))
    return Response(status_code=200)


async def release_memory_occupation(request: Request):
    return await _memory(request, release=True)


async def resume_memory_occupation(request: Request):
    return await _memory(request, release=False)


async def pause_generation(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        mode = f.str("mode", "abort")
        if mode not in PAUSE_MODES:
            raise f.fail("mode", f"must be one of {list(PAUSE_MODES)}")
        f.finish()
    except RequestError as e:
        return json_error(e)
    if mode == "retract":
        try:
            await ctx.service.loop.retract()
        except RuntimeError as e:
            return json_error(RequestError(str(e), status=400, param="mode"))
    else:
        ctx.service.loop.pause()
    if mode == "abort":
        ctx.service.abort(None)
    return JSONResponse({"success": True, "message": f"generation paused (mode {mode})"})


async def continue_generation(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        f.bool("torch_empty_cache", True)
        f.finish()
    except RequestError as e:
        return json_error(e)
    ctx.service.loop.resume()
    return JSONResponse({"success": True, "message": "generation continued"})


async def flush_cache(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        await ctx.service.loop.call(lambda engine: engine.flush_cache() if engine.kv is not None else None)
    except RuntimeError as e:
        return PlainTextResponse(f"Cache not flushed: {e}\n", status_code=400)
    return PlainTextResponse("Cache flushed.\n", status_code=200)


async def update_weight_version(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = await _fields(request)
        version = f.required("new_version")
        if not isinstance(version, str) or not version:
            raise f.fail("new_version", "must be a non-empty string")
        abort = f.bool("abort_all_requests", False)
        f.finish()
    except RequestError as e:
        return json_error(e)
    if abort:
        ctx.service.abort(None)
    ctx.weight_version = version
    return JSONResponse({"success": True, "message": f"weight version updated to {version}", "new_version": version})


async def get_weight_version(request: Request):
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse({"weight_version": ctx.weight_version})


async def _state(ctx: ServerContext) -> dict[str, Any]:
    """Pool occupancy and request counts (read on the engine thread; waiting counts the requests a retract
    pause parked), and the totals since start."""
    loop = ctx.service.loop
    pools = await loop.call(lambda engine: {**engine.pool_stats(), "parked": loop.parked})
    pools["waiting"] += pools.pop("parked")
    totals = loop.totals
    prompt = totals["prompt_tokens"]
    return {
        **pools,
        "paused": loop.paused,
        "memory_released": pools["kv_pages_total"] == 0,
        "cache_hit_rate": totals["cached_tokens"] / prompt if prompt else 0.0,
        "totals": dict(totals),
    }


async def get_server_info(request: Request):
    ctx: ServerContext = request.app.state.ctx
    engine: Engine = ctx.service.loop.engine
    state = await _state(ctx)
    cfg = engine.config
    return JSONResponse(
        {
            "model_path": ctx.model_path,
            "served_model_name": ctx.model_name,
            "tokenizer_path": ctx.tokenizer.name_or_path,
            "weight_version": ctx.weight_version,
            "lora_adapters": list(ctx.adapters),
            # SGLang's server args for the adapter pool (`--max-loras-per-batch`, `--max-lora-rank`)
            "enable_lora": engine.adapters is not None,
            "max_loras_per_batch": engine.adapters.max_adapters if engine.adapters is not None else 0,
            "max_lora_rank": engine.adapters.spec.rank if engine.adapters is not None else None,
            "context_length": ctx.max_seq_len,
            "max_running_requests": cfg.max_running,
            "max_total_num_tokens": ctx.pool_tokens,
            "page_size": cfg.page_size,
            "memory_mb": ctx.memory_mb,
            "version": "miles-k3",
            "internal_states": [
                {
                    "num_running_reqs": state["running"],
                    "num_waiting_reqs": state["waiting"],
                    "kv_pages_used": state["kv_pages_used"],
                    "kv_pages_total": state["kv_pages_total"],
                    "kda_slots_used": state["kda_slots_used"],
                    "kda_slots_total": state["kda_slots_total"],
                    "token_usage": state["kv_pages_used"] / state["kv_pages_total"] if state["kv_pages_total"] else 0.0,
                    "cache_hit_rate": state["cache_hit_rate"],
                    "paused": state["paused"],
                    "memory_released": state["memory_released"],
                }
            ],
        }
    )


def _prometheus(samples: list[tuple[str, str, str, float]]) -> str:
    """(name, type, help, value) -> Prometheus text exposition (labels in the name where given)."""
    lines, seen = [], set()
    for name, kind, text, value in samples:
        base = name.split("{", 1)[0]
        if base not in seen:
            seen.add(base)
            lines += [f"# HELP {base} {text}", f"# TYPE {base} {kind}"]
        lines.append(f"{name} {float(value)!r}")
    return "\n".join(lines) + "\n"


async def metrics(request: Request):
    ctx: ServerContext = request.app.state.ctx
    s = await _state(ctx)
    t = s["totals"]
    pages = s["kv_pages_total"]
    samples = [
        ("sglang:num_running_reqs", "gauge", "requests running", s["running"]),
        ("sglang:num_queue_reqs", "gauge", "requests waiting", s["waiting"]),
        ("sglang:token_usage", "gauge", "fraction of KV pages in use", s["kv_pages_used"] / pages if pages else 0),
        ("sglang:cache_hit_rate", "gauge", "prompt tokens served from the prefix cache", s["cache_hit_rate"]),
        ("sglang:prompt_tokens_total", "counter", "prompt tokens of finished requests", t.get("prompt_tokens", 0)),
        ("sglang:generation_tokens_total", "counter", "tokens generated", t.get("generation_tokens", 0)),
        ("sglang:cached_tokens_total", "counter", "prompt tokens served from the cache", t.get("cached_tokens", 0)),
        ("sglang:num_requests_total", "counter", "requests finished", t.get("requests", 0)),
        ("miles_k3:kv_pages_used", "gauge", "KV pages in use (requests and the prefix cache)", s["kv_pages_used"]),
        ("miles_k3:kv_pages_total", "gauge", "KV pages in the pool", pages),
        ("miles_k3:kda_slots_used", "gauge", "KDA state slots in use", s["kda_slots_used"]),
        ("miles_k3:kda_slots_total", "gauge", "KDA state slots in the pool", s["kda_slots_total"]),
        ("miles_k3:paused", "gauge", "1 while generation is paused", s["paused"]),
        ("miles_k3:memory_released", "gauge", "1 while the KV and state pools are released", s["memory_released"]),
    ]
    for reason in ("stop", "length", "abort"):
        samples.append(
            (
                f'miles_k3:requests_finished_total{{finish_reason="{reason}"}}',
                "counter",
                "requests finished by reason",
                t.get(f"finish_{reason}", 0),
            )
        )
    return PlainTextResponse(_prometheus(samples), media_type="text/plain; version=0.0.4")


def routes() -> list[Route]:
    return [
        Route("/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/release_memory_occupation", release_memory_occupation, methods=["POST"]),
        Route("/resume_memory_occupation", resume_memory_occupation, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/get_weight_version", get_weight_version, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
