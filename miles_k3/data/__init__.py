"""Prompt datasets for RL: config, loading (jsonl / parquet), chat templates, and a resumable sampler.

config = PromptDataConfig(path="prompts.jsonl", chat_template="chatml", seed=1)
sampler = PromptSampler.from_config(config)
batch = sampler.next_batch(8)          # list[PromptRecord]; record.prompt is the engine's input
state = sampler.state_dict()           # goes into the trainer checkpoint
"""

from miles_k3.data.chat_template import CHATML, render_prompt, validate_template
from miles_k3.data.prompts import PromptDataConfig, PromptRecord, dataset_fingerprint, load_prompts
from miles_k3.data.sampler import PromptSampler, epoch_permutation

__all__ = [
    "CHATML",
    "PromptDataConfig",
    "PromptRecord",
    "PromptSampler",
    "dataset_fingerprint",
    "epoch_permutation",
    "load_prompts",
    "render_prompt",
    "validate_template",
]
