"""Composing the shipped recipes the way `miles-train` does (Hydra's compose API, the installed schema)."""

from miles_k3.trainer.config import compose_recipe as composed  # noqa: F401  (the tests' name for it)


def fresh(prompts):
    """Samples of these prompt ids with nothing generated yet (what a rollout backend fills)."""
    from miles_k3.data.sample import Sample

    return [Sample("", prompt_ids=list(p)) for p in prompts]


def random_drafter(path):
    """A random DSpark drafter for the embedded base (reading its layers 1, 3, 5; blocks of 4), saved in `path` as
    scripts/train_drafter.py saves one."""
    import torch

    from rollout.spec.drafter import DSparkConfig, DSparkDrafter

    torch.manual_seed(0)
    config = DSparkConfig(
        target_layers=(1, 3, 5),
        hidden_size=128,
        vocab_size=32,
        block_size=4,
        num_layers=1,
        intermediate_size=64,
        context_window=16,
    )
    DSparkDrafter(config).save(path)
    return path
