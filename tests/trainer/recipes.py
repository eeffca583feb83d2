"""Composing the shipped recipes the way `miles-train` does (Hydra's compose API, the installed schema)."""

from miles_k3.trainer.config import compose_recipe as composed  # noqa: F401  (the tests' name for it)


def fresh(prompts):
    """Samples of these prompt ids with nothing generated yet (what a rollout backend fills)."""
    from miles_k3.data.sample import Sample

    return [Sample("", prompt_ids=list(p)) for p in prompts]
