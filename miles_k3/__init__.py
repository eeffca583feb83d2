"""miles-k3: RL post-training for the Kimi K3 model family.

`miles_k3.model` is the K3 definition shared by the trainer and the rollout engine; `miles_k3.ops` holds
its math once; `miles_k3.kernels` runs some of those ops as Triton kernels in the engine's steps (CUDA,
inference mode), behind one seam the ops ask.
"""

__version__ = "0.1.0"
