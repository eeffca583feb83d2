"""`miles-train`: compose the Hydra recipe, validate it whole, then launch the run.

    miles-train recipe=k3_grpo                                   # the embedded default (tiny K3, CPU)
    miles-train recipe=k3_grpo trainer.max_steps=5 hydra.run.dir=runs/a
    miles-train recipe=k3_grpo --cfg job                         # print the resolved config, run nothing

A config mistake (unknown key, wrong type, bad value) exits with status 2 and one line naming the field,
before any model is built.
"""

from __future__ import annotations

import logging
import sys
import warnings

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miles_k3.trainer.config import register_schema, resolve



@hydra.main(version_base=None, config_path="pkg://recipes", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from miles_k3.trainer.loop import load_run_inputs

    try:
        resolved = resolve(cfg)
        inputs = load_run_inputs(resolved)
    except ValueError as e:
        print(f"miles-train: config error: {e}", file=sys.stderr)
        sys.exit(2)
    from miles_k3.trainer.launch import launch  # megatron-core loads here, after the config is known good

    launch(resolved, HydraConfig.get().runtime.output_dir, inputs)


def main() -> None:
    # megatron-core announces, on import, every optional CUDA library it falls back from; on a CPU laptop
    # that is a screen of noise before the progress bar, and says nothing about this run.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    register_schema()
    _hydra_main()


if __name__ == "__main__":
    main()
