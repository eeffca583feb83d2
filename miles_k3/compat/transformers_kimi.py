"""transformers' KimiLinear as an external oracle / peer.

transformers binds fla's Triton kernels when `import fla` succeeds, which it
does on a CPU machine once triton is installed; those kernels then fail
without a GPU. `use_torch_fallbacks()` rebinds the module's KDA and conv
functions to the pure-torch fallbacks transformers keeps as `__wrapped__`.
"""

from __future__ import annotations

import inspect

_KERNEL_BOUND = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def use_torch_fallbacks() -> None:
    import transformers.models.kimi_linear.modeling_kimi_linear as mkl

    for name in _KERNEL_BOUND:
        setattr(mkl, name, inspect.unwrap(getattr(mkl, name)))
