"""The engine's front-door settings, with their defaults and checks: `EngineFlags`, the engine flags that
`miles-serve` and `miles-k3 generate` share (defined once, here), and `ServeConfig`, miles-serve's (the
engine flags and the server's own).

One field per command-line flag (`--max-queued` is `max_queued`); `add_flags` builds a parser's flags from
these fields and their help texts, so a default lives here only. The engine's own knobs that the flags
expose (`max_running`, `max_seq_len`, `max_prefill_tokens`) default to None: EngineConfig's defaults then
apply. `check()` raises ValueError("--<flag> <rule>, got <value>") before any model is loaded; `engine_spec()`
is the `rollout.build.EngineSpec` the flags describe, and `flag_errors` renames a build's
"EngineSpec.<field>" errors to the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import math
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from miles_k3.data.tokenizers import TOKENIZERS
from miles_k3.model.assets import BUILTIN_PREFIX, builtin_models, builtin_path
from miles_k3.model.base import DTYPES
from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec, adaptable_modules, matches_targets
from rollout.build import EngineSpec
from rollout.config import EngineConfig
from rollout.model_runner import QUANTIZE_MODES

DEVICES = ("cpu", "cuda")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SPECULATIVE = ("off", "dspark")
# the flag that sets an EngineSpec field, where it is not --<field> (`flag_errors`)
SPEC_FLAGS = {"path": "--model", "adapters": "--adapter", "lora": "--adapter", "max_adapters": "--max-loras"}


def flag_name(name: str) -> str:
    """A field's flag: `max_queued` -> `--max-queued`."""
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Iterable[str]) -> None:
    """One flag per field of the dataclass `cls` named in `names`, in that order: its help text
    (`metadata["help"]`) and default from the field, its type from `metadata["type"]` or else the default's
    (int, float; otherwise str), `metadata["nargs"]` when it takes several values, and `metadata["aliases"]`
    (other spellings of the flag, e.g. SGLang's). A field without a default is a required flag."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = fields[name]
        flags = (flag_name(name), *f.metadata.get("aliases", ()))
        if f.default is dataclasses.MISSING:
            parser.add_argument(*flags, required=True, help=f.metadata["help"])
            continue
        if isinstance(f.default, bool):  # a switch: the flag alone turns it on
            parser.add_argument(*flags, action="store_true", default=f.default, help=f.metadata["help"])
            continue
        kind = f.metadata.get("type") or {int: int, float: float}.get(type(f.default), str)
        extra = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
        parser.add_argument(*flags, type=kind, default=f.default, help=f.metadata["help"], **extra)


@contextlib.contextmanager
def flag_errors() -> Iterator[None]:
    """Inside: a ValueError "EngineSpec.<field> ..." (`rollout.build`) becomes "<the field's flag> ..."."""
    try:
        yield
    except ValueError as e:
        m = re.match(r"EngineSpec\.(\w+)", str(e))
        if m is None:
            raise
        flag = SPEC_FLAGS.get(m.group(1), flag_name(m.group(1)))
        raise ValueError(flag + str(e)[m.end() :]) from None


class _Check:
    """`obj`'s fields checked, each failure a ValueError "--<flag> <rule>, got <value>"."""

    def __init__(self, obj):
        self.obj = obj

    def fail(self, name: str, rule: str) -> ValueError:
        return ValueError(f"{flag_name(name)} {rule}, got {getattr(self.obj, name)!r}")

    def int_at_least(self, name: str, low: int, optional: bool = False) -> None:
        v = getattr(self.obj, name)
        if optional and v is None:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(name, f"must be an integer >= {low}")

    def positive(self, name: str) -> None:
        v = getattr(self.obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.fail(name, "must be a number > 0")

    def choice(self, name: str, options: tuple, optional: bool = False) -> None:
        v = getattr(self.obj, name)
        if not (optional and v is None) and v not in options:
            raise self.fail(name, f"must be one of {options}")


def check_adapters(adapters: tuple[tuple[str, str], ...], model_name: str) -> None:
    """--adapter NAME=PEFT_DIR entries: names non-empty, distinct and not the base's; directories that exist."""
    names = [name for name, _ in adapters]
    for name, path in adapters:
        if not name or "=" in name:
            raise ValueError(f"--adapter entries must be NAME=PEFT_DIR with a non-empty NAME, got {adapters!r}")
        if name == model_name:
            raise ValueError(f"--adapter name {name!r} is the base model's served name, got {adapters!r}")
        if not Path(path).is_dir():
            raise ValueError(f"--adapter {name}={path}: no such directory")
    if len(set(names)) != len(names):
        raise ValueError(f"--adapter names must be distinct, got {adapters!r}")


def check_host(host: str) -> None:
    """ValueError naming --host unless it is an IP address or a name this machine resolves (an address that
    looks numeric must parse as one: 256.1.1.1 is refused, not looked up)."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"--host must be an address to listen on, got {host!r}")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        raise ValueError(f"--host {host}: not a valid IPv4 or IPv6 address")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e})") from None


@dataclass(frozen=True)
class EngineFlags:
    """The engine's flags, shared by `miles-serve` (ServeConfig) and `miles-k3 generate` (GenerateArgs): the
    checkpoint and its tokenizer, where and how the engine holds it, its memory and batch limits, and
    speculative decoding. Each field's help text (its `metadata["help"]`) is the flag's help."""

    model: str = field(
        metadata={
            "help": "an HF checkpoint directory (config.json, safetensors, the tokenizer's "
            "files) or builtin:<name> (an embedded model, e.g. builtin:k3-tiny-arith)"
        }
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": f"one of {TOKENIZERS}: the embedded models' character tokenizer, or transformers' AutoTokenizer "
            "from the checkpoint; default: arithmetic for builtin:, hf for a directory"
        },
    )
    device: str = field(default="cpu", metadata={"help": f"one of {DEVICES}"})
    dtype: str | None = field(
        default=None,
        metadata={
            "help": f"one of {DTYPES}: the engine's compute and KV dtype; default: bfloat16 on cuda, float32 on cpu"
        },
    )
    quantize: str = field(
        default="experts",
        metadata={
            "help": f"one of {QUANTIZE_MODES}: the frozen base as stored, MXFP4 routed experts, or every projection"
        },
    )
    memory_mb: float = field(
        default=64.0, metadata={"help": "the engine's KV pages + KDA state slots (each rank's, when sharded), in MiB"}
    )
    max_running: int | None = field(
        default=None, metadata={"help": "requests decoding at once; default: EngineConfig's", "type": int}
    )
    max_seq_len: int | None = field(
        default=None,
        metadata={"help": "prompt + generated tokens of one request; default: EngineConfig's", "type": int},
    )
    speculative: str = field(
        default="off",
        metadata={
            "help": f"one of {SPECULATIVE}: dspark drafts a block with --drafter and verifies it in one target "
            "forward (lossless: the same tokens and distribution as without)"
        },
    )
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "with --speculative dspark: a DSpark drafter directory (scripts/train_drafter.py writes one) or "
            "builtin:<name> (e.g. builtin:k3-tiny-steps/drafter)"
        },
    )
    gamma: int | None = field(
        default=None,
        metadata={"help": "with --speculative: drafts per verify block; default: SpecConfig's", "type": int},
    )
    spec_planner: str | None = field(
        default=None,
        metadata={
            "help": "with --speculative: verify_all or cost_aware (how many drafts a verify checks); default: "
            "SpecConfig's"
        },
    )
    spec_max_batch: int | None = field(
        default=None,
        metadata={
            "help": "with --speculative: speculate only while at most this many requests decode together; larger "
            "batches decode one token a step; default: always speculate",
            "type": int,
        },
    )
    tp: int = field(
        default=1,
        metadata={
            "help": "engine ranks, one process each (a GPU each with --device cuda): attention heads, the "
            "vocabulary and the routed experts split over them (rollout.parallel)"
        },
    )
    dcp: int = field(
        default=1, metadata={"help": "with --tp: ranks per decode-context-parallel group (MLA's KV split by position)"}
    )
    ep: bool = field(
        default=False,
        metadata={"help": "with --tp: whole routed experts, num_experts / tp per rank (else split by their width)"},
    )

    # ----------------------------------------------------------------- derived
    @property
    def model_path(self) -> Path:
        """The checkpoint directory (a builtin: asset resolved inside the package)."""
        return Path(builtin_path(self.model))

    @property
    def tokenizer_kind(self) -> str:
        if self.tokenizer is not None:
            return self.tokenizer
        return "arithmetic" if self.model.startswith(BUILTIN_PREFIX) else "hf"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    def engine_overrides(self) -> dict:
        """The EngineConfig fields these flags set (the others keep EngineConfig's defaults)."""
        names = ("max_running", "max_seq_len")
        fields = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if (spec := self.speculation()) is not None:
            fields["speculation"] = spec
        return fields

    def engine_config(self) -> EngineConfig:
        """The engine's EngineConfig: --memory-mb and `engine_overrides`."""
        return EngineConfig(memory_bytes=int(self.memory_mb * (1 << 20)), **self.engine_overrides())

    def engine_spec(self, **fields) -> EngineSpec:
        """The `rollout.build.EngineSpec` of these flags (check them first); `fields` set its other fields (the
        adapters, the layout, a sharded rank's device) or replace these (a preset base, for benchmarks)."""
        with flag_errors():
            return EngineSpec(
                **{
                    "path": str(self.model_path),
                    "quantize": self.quantize,
                    "dtype": self.dtype,
                    "device": self.device,
                    "engine": self.engine_config(),
                    "tp": self.tp,
                    "ep": self.tp if self.ep else 1,
                    "dcp": self.dcp,
                    **fields,
                }
            )

    def speculation(self):
        """EngineConfig.speculation for these flags: None (off) or a SpecConfig, which checks its fields
        (gamma and the planner keep SpecConfig's defaults when not given)."""
        if self.speculative == "off":
            return None
        from rollout.spec import SpecConfig

        given = {
            k: v
            for k, v in (("gamma", self.gamma), ("planner", self.spec_planner), ("max_batch", self.spec_max_batch))
            if v is not None
        }
        try:
            return SpecConfig(drafter=Path(builtin_path(self.drafter)), **given)
        except ValueError as e:  # "SpecConfig.gamma must ..." -> the flag's name
            raise ValueError(
                str(e)
                .replace("SpecConfig.planner", "--spec-planner")
                .replace("SpecConfig.gamma", "--gamma")
                .replace("SpecConfig.max_batch", "--spec-max-batch")
            ) from None

    def check_pool(self, config, tp: int = 1, dcp: int = 1):
        """The engine's pools (`rollout.memory.PoolSizes`) as --memory-mb sizes them on each of `tp` ranks for
        the model `config`; ValueError naming --memory-mb when they cannot hold one KV page and one KDA state
        slot. Reads no weights: for the front doors, before the engine is built."""
        from miles_k3.model.base import TORCH_DTYPES
        from rollout.memory import PoolSizes

        engine = self.engine_config()
        try:
            return PoolSizes.from_budget(
                config,
                engine.memory_bytes,
                page_size=engine.page_size,
                state_fraction=engine.state_fraction,
                dtype=TORCH_DTYPES[self.resolved_dtype],
                tp_size=tp,
                dcp_size=dcp,
            )
        except ValueError as e:
            raise ValueError(f"--memory-mb {self.memory_mb:g}: {e}") from None

    # ------------------------------------------------------------------- check
    def check(self) -> None:
        """The engine flags (ValueError naming the flag); the commands' `check` calls it with their own."""
        c = _Check(self)
        if not isinstance(self.model, str) or not self.model:
            raise c.fail("model", f"must be a checkpoint directory or {BUILTIN_PREFIX}<name>")
        if not (self.model_path / "config.json").is_file():
            if self.model.startswith(BUILTIN_PREFIX):
                raise c.fail("model", f"names no embedded model; known: {builtin_models()}")
            raise c.fail("model", "must be a directory holding config.json (an HF checkpoint)")
        c.choice("tokenizer", TOKENIZERS, optional=True)
        c.choice("device", DEVICES)
        c.choice("dtype", DTYPES, optional=True)
        c.choice("quantize", QUANTIZE_MODES)
        c.positive("memory_mb")
        c.int_at_least("max_running", 1, optional=True)
        # one prompt token and one new token at the least
        c.int_at_least("max_seq_len", 2, optional=True)
        from miles_k3.errors import check_memory_mb

        check_memory_mb(self.memory_mb, self.device, "--memory-mb")
        c.int_at_least("tp", 1)
        c.int_at_least("dcp", 1)
        if self.ep and self.tp == 1:
            raise ValueError("--ep needs --tp > 1: expert parallelism runs over the tensor-parallel ranks")
        if self.tp % self.dcp:
            raise ValueError(
                f"--dcp {self.dcp} must divide --tp {self.tp}: decode context parallelism runs inside "
                f"the tensor-parallel group"
            )
        if self.tp > 1 and self.device == "cpu":  # every rank's pools on this one host
            check_memory_mb(self.memory_mb * self.tp, "cpu", f"--memory-mb {self.memory_mb:g} x --tp {self.tp} =")
        if self.tp > 1 and self.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.tp:
                raise ValueError(f"--tp {self.tp} needs a GPU per rank; this host has {torch.cuda.device_count()}")
        c.choice("speculative", SPECULATIVE)
        if (self.speculative != "off") != (self.drafter is not None):
            raise ValueError("--speculative dspark and --drafter go together")
        if self.drafter is not None and not (Path(builtin_path(self.drafter)) / "config.json").is_file():
            raise ValueError(
                f"--drafter {self.drafter}: no drafter here (config.json; scripts/train_drafter.py writes one)"
            )
        if self.drafter is not None:
            from rollout.spec.drafter import DSparkConfig

            file = Path(builtin_path(self.drafter)) / "config.json"
            try:
                DSparkConfig(**json.loads(file.read_text()))
            except (TypeError, ValueError) as e:  # not JSON, not an object, or fields DSparkConfig refuses
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ValueError(
                    f"--drafter {self.drafter}: {file} is not a DSpark drafter config ({reason})"
                ) from None
        self.speculation()
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise c.fail("device", "is cuda but no CUDA device is available")


ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineFlags))


@dataclass(frozen=True)
class ServeConfig(EngineFlags):
    """miles-serve's settings: the engine flags (`EngineFlags`) and the server's own below. Each field's help
    text (its `metadata["help"]`) is the flag's help in `miles-serve --help`."""

    adapters: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata={
            "help": "NAME=PEFT_DIR: a PEFT LoRA adapter (as the trainer saves it) served under the model name NAME; "
            "repeat for several (all of one rank and module set, unless --max-lora-rank shapes the pool)"
        },
    )
    max_loras: int | None = field(
        default=None,
        metadata={
            "help": "adapter slots in the pool (SGLang's --max-loras-per-batch): adapters loaded at once, by --adapter "
            "or at runtime (/load_lora_adapter); default: one per --adapter, at least 1",
            "type": int,
            "aliases": ("--max-loras-per-batch",),
        },
    )
    max_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "the adapter pool's rank: the server builds a pool of --max-loras slots over "
            "--lora-target-modules, with or without --adapter, that takes adapters of this rank or lower "
            "(zero-padded) at start or at runtime; default: the --adapter's rank and modules (no --adapter: no pool)",
            "type": int,
        },
    )
    lora_target_modules: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "with --max-lora-rank: the modules the pool adapts, 'all' (the default: every adaptable module "
            "of the model) or regexes searched in their names (e.g. q_proj o_proj 'experts\\.w[13]$')",
            "nargs": "+",
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "the base model's name in the APIs (/v1/models, the model field); default: --model as given"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "the address to listen on"})
    port: int = field(
        default=30000,
        metadata={
            "help": "the port to listen on (SGLang's default, so rollout code pointed at SGLang finds us); 0: any free"
        },
    )
    max_prefill_tokens: int | None = field(
        default=None, metadata={"help": "prompt tokens prefilled per engine step; default: EngineConfig's", "type": int}
    )
    record_routing: bool = field(
        default=False,
        metadata={
            "help": "record every token's routed experts (SGLang's --enable-return-routed-experts), which /generate "
            "returns with return_routed_experts (an RL trainer's routing replay); decode then runs without CUDA "
            "graphs"
        },
    )
    max_queued: int = field(
        default=256,
        metadata={"help": "samples that may wait for a decode slot beyond the max-running ones; past that, 429"},
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata={"help": "after SIGINT/SIGTERM: seconds in-flight requests get to finish before they are aborted"},
    )
    log_level: str = field(default="info", metadata={"help": f"one of {LOG_LEVELS}"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(tuple(a) for a in self.adapters))
        if isinstance(self.lora_target_modules, list):  # argparse's nargs
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))

    @property
    def model_name(self) -> str:
        return self.served_model_name if self.served_model_name is not None else self.model

    def adapter_pool(self, config: K3Config) -> LoraSpec | None:
        """The adapter pool the flags shape for the model `config`: rank --max-lora-rank over the modules
        --lora-target-modules selects among `adaptable_modules(config)` (all of them by default, or with
        'all'); None without --max-lora-rank (the pool then takes the --adapter's own shape, or there is none).
        ValueError naming --lora-target-modules for a pattern that selects no adaptable module."""
        if self.max_lora_rank is None:
            return None
        modules = adaptable_modules(config)
        patterns = self.lora_target_modules or ("all",)
        if "all" not in patterns:
            for p in patterns:
                if not any(re.search(p, m) for m in modules):
                    raise ValueError(
                        f"--lora-target-modules {p!r} matches no adaptable module of {self.model} (they are named "
                        f"like {modules[0]!r} and {modules[-1]!r})"
                    )
            modules = [m for m in modules if matches_targets(patterns, m)]
        # one anchored alternation of the chosen names: exactly those modules, whatever else a pattern matches
        return LoraSpec(rank=self.max_lora_rank, targets=("^(?:" + "|".join(map(re.escape, modules)) + ")$",))

    def engine_overrides(self) -> dict:
        fields = super().engine_overrides()
        if self.max_prefill_tokens is not None:
            fields["max_prefill_tokens"] = self.max_prefill_tokens
        if self.record_routing:
            fields["record_routing"] = True
        return fields

    def engine_spec(self, **fields) -> EngineSpec:
        """The served engine's spec: the engine flags' with the adapter pool. Without --max-lora-rank the
        adapters are the spec's (loaded at build; the pool takes their shape) in --max-loras slots; with it the
        pool is `adapter_pool`'s and holds no adapter yet: `rollout.server.loading.load_served` loads the
        --adapter ones into it (`load_adapter`, as /load_lora_adapter does), padding lower ranks."""
        slots = {"max_adapters": self.max_loras} if self.max_loras is not None else {}
        if self.max_lora_rank is None:
            return super().engine_spec(**{"adapters": self.adapters, **slots, **fields})
        spec = super().engine_spec(**{"max_adapters": self.max_loras or max(1, len(self.adapters)), **fields})
        return dataclasses.replace(spec, lora=self.adapter_pool(spec.base_config()))

    def check(self) -> None:
        super().check()
        c = _Check(self)
        check_adapters(self.adapters, self.model_name)
        c.int_at_least("max_loras", 1, optional=True)
        c.int_at_least("max_lora_rank", 1, optional=True)
        if self.max_loras is not None and self.max_loras < len(self.adapters):
            raise c.fail("max_loras", f"must hold the {len(self.adapters)} --adapter given")
        if self.max_loras is not None and self.max_lora_rank is None and not self.adapters:
            raise ValueError(
                f"--max-loras {self.max_loras} needs --max-lora-rank (the pool's rank) or an --adapter (whose rank "
                "and modules shape the pool)"
            )
        if self.lora_target_modules is not None:
            if self.max_lora_rank is None:
                raise ValueError("--lora-target-modules needs --max-lora-rank (the pool it shapes)")
            for p in self.lora_target_modules:
                if not isinstance(p, str) or not p:
                    raise c.fail("lora_target_modules", "must be 'all' or non-empty regexes")
                try:
                    re.compile(p)
                except re.error as e:
                    raise ValueError(f"--lora-target-modules {p!r}: not a regex ({e})") from None
        if self.served_model_name is not None and not self.served_model_name:
            raise c.fail("served_model_name", "must be non-empty")
        c.int_at_least("port", 0)
        if self.port > 65535:
            raise c.fail("port", "must be <= 65535")
        check_host(self.host)
        c.int_at_least("max_prefill_tokens", 1, optional=True)
        c.int_at_least("max_queued", 0)
        if (
            isinstance(self.shutdown_timeout, bool)
            or not isinstance(self.shutdown_timeout, (int, float))
            or not self.shutdown_timeout >= 0
        ):
            raise c.fail("shutdown_timeout", "must be a number >= 0")
        c.choice("log_level", LOG_LEVELS)
