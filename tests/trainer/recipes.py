"""Composing the shipped recipes the way `miles-train` does (Hydra's compose API, the installed schema)."""

from hydra import compose, initialize_config_module

from miles_k3.trainer.config import register_schema


def composed(*overrides):
    register_schema()
    with initialize_config_module(config_module="recipes", version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def fresh(prompts):
    """Samples of these prompt ids with nothing generated yet (what a rollout backend fills)."""
    from miles_k3.data.sample import Sample

    return [Sample("", prompt_ids=list(p)) for p in prompts]
