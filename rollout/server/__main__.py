"""miles-serve (also `python -m rollout.server`): serve a K3 checkpoint over OpenAI's and SGLang's HTTP APIs.

    miles-serve --model builtin:k3-tiny-arith --port 30000
    miles-serve --model /path/to/checkpoint --adapter policy=runs/grpo/adapter --device cuda
    miles-serve --model builtin:k3-tiny-steps --speculative dspark --drafter builtin:k3-tiny-steps/drafter
    miles-serve --model /path/to/Kimi-K3 --device cuda --tp 16 --ep           # one engine over 16 GPUs

Reads the flags into a ServeConfig (its fields and help texts are the flags: the engine's, shared with `miles-k3
generate`, then the server's), loads the model, the tokenizer and the adapters, then serves until SIGINT/SIGTERM
and exits 0. With --tp N it spawns N engine ranks (`miles_k3.ranks.spawn_ranks`): rank 0 serves, the others
replay its engine calls, and a stop signal reaches rank 0, which shuts down and releases them. A bad flag,
checkpoint or adapter, or an address it cannot listen on, stops it before anything is served, with one line
naming it (exit status 2: `miles_k3.errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from miles_k3.errors import OneLineParser, guarded
from rollout.server.config import ServeConfig, add_flags


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="miles-serve", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    names = [f.name for f in dataclasses.fields(ServeConfig)]
    add_flags(parser, ServeConfig, names[: names.index("adapters")])
    parser.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        metavar="NAME=PEFT_DIR",
        help=ServeConfig.__dataclass_fields__["adapters"].metadata["help"],
    )
    add_flags(parser, ServeConfig, names[names.index("adapters") + 1 :])
    return parser


def parse_config(argv: list[str] | None = None) -> ServeConfig:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    adapters = []
    for item in args["adapters"]:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"--adapter {item!r}: expected NAME=PEFT_DIR")
        adapters.append((name, path))
    args["adapters"] = tuple(adapters)
    return ServeConfig(**args)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if guarded("miles-serve", lambda: _check(cfg)):  # a mistake: one line, status 2
        raise SystemExit(2)
    if cfg.tp > 1:
        import tempfile
        from pathlib import Path

        from miles_k3.ranks import free_port, spawn_ranks
        from rollout.server.launch import serve_rank

        with tempfile.TemporaryDirectory(prefix="miles-serve-") as tmp:
            # rank 0 serves, the others replay its engine calls; a stop signal goes to rank 0
            run = lambda: spawn_ranks(serve_rank, cfg.tp, (free_port(), cfg), Path(tmp), signals_to_leader=True)  # noqa: E731
            if guarded("miles-serve", run):
                raise SystemExit(2)
        return
    from rollout.server.launch import serve, start

    started = []
    if guarded("miles-serve", lambda: started.append(start(cfg))):
        raise SystemExit(2)
    serve(*started[0])


def _check(cfg: ServeConfig) -> None:
    """The flags, then --memory-mb against the model (each rank's share), before any weight is read."""
    cfg.check()
    cfg.check_pool(cfg.engine_spec().base_config(), cfg.tp, cfg.dcp)


if __name__ == "__main__":
    main()
