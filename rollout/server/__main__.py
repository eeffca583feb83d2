"""miles-serve (also `python -m rollout.server`): serve a K3 checkpoint over OpenAI's and SGLang's HTTP APIs.

    miles-serve --model builtin:k3-tiny-arith --port 30000
    miles-serve --model /path/to/checkpoint --adapter policy=runs/grpo/adapter --device cuda
    miles-serve --model builtin:k3-tiny-steps --speculative dspark --drafter builtin:k3-tiny-steps/drafter

Reads the flags into a ServeConfig (its fields and help texts are the flags: the engine's, shared with
`miles-k3 generate`, then the server's), loads the model, the tokenizer and the adapters, then serves until
SIGINT/SIGTERM and exits 0. A bad flag, checkpoint or adapter, or an address it cannot listen on, stops it
before anything is served, with one line naming it (exit status 2: `miles_k3.errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from miles_k3.errors import OneLineParser, guarded, user_error
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
    from rollout.server.app import Server  # after the flags parse: --help stays fast
    from rollout.server.loading import load_served

    def start():
        try:
            cfg.check()
            cfg.check_pool(cfg.engine_spec().base_config())  # --memory-mb against the model, before its weights
            served = load_served(cfg)  # then the files the flags name
        except OSError as e:  # a file the flags name that cannot be read
            raise ValueError(user_error(e)) from None
        try:
            return served, Server(
                served,
                max_queued=cfg.max_queued,
                host=cfg.host,
                port=cfg.port,
                shutdown_timeout=cfg.shutdown_timeout,
                log_level=cfg.log_level,
            )
        except OSError as e:  # the address is taken, or cannot be bound
            raise ValueError(f"--host {cfg.host} --port {cfg.port}: cannot listen: {user_error(e)}") from None

    started = []
    if guarded("miles-serve", lambda: started.append(start())):  # a mistake: one line, status 2
        raise SystemExit(2)
    served, server = started[0]
    print(
        f"miles-serve: serving {cfg.model_name} (adapters: {list(served.adapters) or 'none'}) on {server.url}",
        flush=True,
    )
    server.run()
    print("miles-serve: stopped", flush=True)


if __name__ == "__main__":
    main()
