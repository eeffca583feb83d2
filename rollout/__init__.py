"""The rollout engine: scheduler, memory pools and hybrid radix cache, model runner (MXFP4 + LoRA linears
through `miles_k3.model.linear`, paged state through `miles_k3.model.cache.K3StateCache`), speculation,
kernels.

Empty until the engine issue lands; the model it serves is `miles_k3.model`.
"""
