"""K3 on megatron-core (trainer side): layer specs, KDA / MLA / AttnRes / LatentMoE built on megatron's
parallel linears through `miles_k3.model.linear.LinearFactory`, LoRA adapters, PP bank packing, CP relayout.

Empty until the trainer issue lands; the math it builds on is `miles_k3.model` and `miles_k3.ops`.
"""
