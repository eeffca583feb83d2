"""The rollout engine: serves the frozen K3 base (MXFP4 or BF16) with LoRA adapters updated in place, by
continuous batching over paged MLA KV and KDA state slots with a hybrid radix prefix cache. It runs the
shared `miles_k3.model` definition: engine linears through its factories, paged state through its
`K3StateCache` protocol. A request's life through these files: docs/structures.md.

    engine.py         Engine: wires the parts; submit / step / generate / stream / abort, adapters, colocation
    config.py         EngineConfig: the engine's settings, defaults and checks
    request.py        SamplingParams, Request, Completion
    media.py          a prompt's images: checks at submit, features once per content, cache keys, prefill splice
    scheduler.py      Scheduler: queues, admission, a plan per step (prefill chunks or a decode batch)
    cache_manager.py  CacheManager: per-request pages / slots and every handover with the radix cache
    decode.py         DecodePipeline (overlap schedule) and the DecodeStrategy seam (OneToken; the engine's
                      strategy_for picks one)
    model_runner.py   build_engine_model (HF tensors -> engine model) and ModelRunner (one forward)
    forward.py        model_step and DecodeGraphs (CUDA-graph decode per batch / history bucket)
    state_cache.py    BatchLayout and PoolStateCache: the K3StateCache over the pools
    attention.py      absorbed MLA attention over the KV pages
    memory.py         index allocators, KV page pool, KDA state pool, pool sizing (per-rank shares)
    unified_memory.py one byte pool for both kinds of state, growing from both ends (unified_memory=True)
    radix_cache.py    HybridRadixCache: KV pages shared by prefix, sparse KDA checkpoints
    linears.py        EngineLinear / EngineExperts: MXFP4 or BF16 base plus the pool's LoRA term
    lora.py           AdapterPool: named adapter slots of one LoraSpec
    sampler.py        batched sampling with exact untruncated log-probs
    noise.py          sampling noise as a function of (request seed, token position, vocabulary index)
    transfer.py       host-to-device copies that never wait for the device
    parallel.py       the sharded engine: EngineTP (TP / EP / DCP shares), rank 0's calls replayed by the
                      others
    build.py          EngineSpec and build_engine: the one engine builder (every front door's), and
                      build_sharded_engine
    dcp.py            decode context parallelism: MLA KV rows by token position, partial attention + LSE merge
    spec/             speculative decoding: SpecConfig, lossless verification, SpecDecode (ReplaySSM fold),
                      the DSpark drafter, the cost-aware verify planner
    kernels/          Triton kernels: MXFP4 grouped GEMM, mixed-adapter LoRA rows, sampling, paged MLA attention
"""
