"""The K3 model definition shared by the trainer and the rollout engine."""

from miles_k3.model.cache import DenseStateCache, K3StateCache, KDAState
from miles_k3.model.config import K3Config, hybrid_layer_kinds
from miles_k3.model.linear import ExpertsSpec, LinearSpec
from miles_k3.model.modeling import K3ForCausalLM, K3Output, MediaEmbeds

__all__ = [
    "DenseStateCache",
    "ExpertsSpec",
    "K3Config",
    "K3ForCausalLM",
    "K3Output",
    "K3StateCache",
    "KDAState",
    "LinearSpec",
    "MediaEmbeds",
    "hybrid_layer_kinds",
]
