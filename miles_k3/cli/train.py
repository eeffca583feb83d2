"""`miles-train`: compose the Hydra recipe, check it and every input the run reads, then launch the run.

    miles-train recipe=k3_grpo                                   # the embedded default (tiny K3, CPU)
    miles-train recipe=k3_grpo trainer.max_steps=5 hydra.run.dir=runs/a
    miles-train model=hf_checkpoint model.path=/dir data.path=prompts.jsonl ...   # your own model and data
    miles-train recipe=k3_grpo --cfg job                         # print the whole config, run nothing

A user's mistake exits with status 2 and one line on stderr naming the field or the file, before any model
is built: an unknown key or group option, a wrong type, a bad value (`resolve`), a run directory that
cannot be written, a device, checkpoint, tokenizer, dataset or reward plugin that cannot be used
(`load_run_inputs`). A reward plugin that fails on the run's own samples stops it the same way. Anything
else is a bug of ours and keeps its traceback.

Hydra would report the first two itself, over several lines and with status 1, before our task function
runs: `precheck` composes the same config first (Hydra's compose API over the same search path, --config-dir
included, and the same overrides) to report them our way (a recipe YAML that does not parse, a key added
with `+` that the schema lacks too), and resolves it, so that a bad value does not even create the run
directory. Hydra's own flags are parsed there too, so a malformed one is one line as well.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miles_k3 import errors
from miles_k3.trainer.base import quiet_megatron
from miles_k3.trainer.config import register_schema
from miles_k3.trainer.resolve import config_error, resolve

PROG = "miles-train"


def fail(message: object) -> None:
    """Report a user's mistake as one line and exit with status 2."""
    errors.fail(PROG, message)


def check_run_dir(run_dir: str) -> None:
    """ValueError naming hydra.run.dir unless the run directory exists as a writable directory or can be
    created (probed by making a directory where it would go; nothing is left behind)."""
    path = Path(run_dir).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"hydra.run.dir: {path} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"hydra.run.dir: cannot create {path}: {parent} is not a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".miles-train-probe-", dir=parent)).rmdir()
    except OSError as e:
        raise ValueError(f"hydra.run.dir: cannot write {path}: {e.strerror or e} ({parent})") from None


@contextlib.contextmanager
def _config_search(config_dir: str | None):
    """Hydra's compose API over the search path `hydra.main` builds: recipes/ and, with --config-dir, that
    directory first (as Hydra adds it). ValueError naming --config-dir when it is not a directory."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    search = create_automatic_config_search_path(None, None, "pkg://recipes")
    if config_dir is not None:
        path = Path(config_dir).absolute()
        if not path.is_dir():
            raise ValueError(f"--config-dir {config_dir}: no such directory")
        search.prepend(provider="command-line", path=f"file://{path}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name=PROG, config_search_path=search)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def precheck(argv: list[str]) -> None:
    """Compose the config as `hydra.main` will (--config-dir included), resolve it and check the run directory;
    ValueError (one line) for what Hydra would otherwise report itself (a malformed flag too), and for a bad
    value before Hydra creates the run directory. Runs that Hydra handles differently (--help, --multirun,
    another primary config) are left to it."""
    from hydra import compose
    from hydra._internal.utils import get_args_parser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    parser = get_args_parser()

    def refuse(message: str):  # a malformed flag: one line, not argparse's usage block
        raise ValueError(message)

    parser.error = refuse
    args = parser.parse_args(argv)
    if (
        args.help
        or args.hydra_help
        or args.info
        or args.shell_completion
        or args.multirun
        or args.config_path
        or args.config_name
        or args.experimental_rerun
    ):
        return
    try:
        with _config_search(args.config_dir):
            cfg = compose(config_name="train", overrides=args.overrides, return_hydra_config=True)
            run_dir = None if args.cfg else str(cfg.hydra.run.dir)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(config_error(e)) from None
    except yaml.YAMLError as e:  # a recipe file (ours, or one under --config-dir) that does not parse
        raise ValueError(f"a recipe YAML does not parse: {e}") from None
    if run_dir is not None:
        check_run_dir(run_dir)
    with open_dict(cfg):
        del cfg["hydra"]
    if "${hydra:" not in OmegaConf.to_yaml(cfg):  # (those resolve only inside Hydra's run: the task checks them)
        resolve(cfg)


@hydra.main(version_base=None, config_path="pkg://recipes", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from miles_k3.rewards import RewardPluginError
    from miles_k3.trainer.inputs import load_run_inputs

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        rc = resolve(cfg)
        inputs = load_run_inputs(rc, run_dir)
    except (ValueError, OSError) as e:  # OSError: a file the config names that cannot be read
        fail(errors.user_error(e))
    from miles_k3.trainer.launch import launch  # megatron-core loads here, after the inputs are known good

    try:
        launch(rc, run_dir, inputs)
    except RewardPluginError as e:  # the user's plugin failed on real samples (reward.on_failure=raise)
        fail(f"reward.fn: {e}")


def main() -> None:
    quiet_megatron()
    register_schema()
    try:
        precheck(sys.argv[1:])
    except (ValueError, OSError) as e:
        fail(errors.user_error(e))
    _hydra_main()


if __name__ == "__main__":
    main()
