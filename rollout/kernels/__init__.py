"""The engine's Triton kernels (CUDA; tests run them on CPU under TRITON_INTERPRET=1)."""
