"""ServeConfig: what `miles-serve` runs, with its defaults and checks.

One field per command-line flag (`--max-queued` is `max_queued`); `rollout.server.__main__` builds its
parser from these fields and their help texts, so a default lives here only. The engine's own knobs that
the server exposes (`max_running`, `max_seq_len`, `max_prefill_tokens`) default to None: EngineConfig's
defaults then apply.
`check()` raises ValueError("--<flag> <rule>, got <value>") before any model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from miles_k3.trainer.config import BUILTIN_PREFIX, TOKENIZERS, builtin_path
from rollout.model_runner import QUANTIZE_MODES

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SPECULATIVE = ("off", "dspark")


@dataclass(frozen=True)
class ServeConfig:
    """Each field's help text (its `metadata["help"]`) is the flag's help in `miles-serve --help`."""

    model: str = field(metadata={"help": "an HF checkpoint directory (config.json, safetensors, the tokenizer's "
                                         "files) or builtin:<name> (an embedded model, e.g. builtin:k3-tiny-arith)"})
    adapters: tuple[tuple[str, str], ...] = field(default=(), metadata={
        "help": "NAME=PEFT_DIR: a PEFT LoRA adapter (as the trainer saves it) served under the model name NAME; "
                "repeat for several (all of one rank and module set)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the base model's name in the APIs (/v1/models, the model field); default: --model as given"})
    tokenizer: str | None = field(default=None, metadata={
        "help": f"one of {TOKENIZERS}: the embedded models' character tokenizer, or transformers' AutoTokenizer "
                "from the checkpoint; default: arithmetic for builtin:, hf for a directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "the address to listen on"})
    port: int = field(default=30000, metadata={
        "help": "the port to listen on (SGLang's default, so rollout code pointed at SGLang finds us); 0: any free"})
    device: str = field(default="cpu", metadata={"help": f"one of {DEVICES}"})
    dtype: str | None = field(default=None, metadata={
        "help": f"one of {DTYPES}: the engine's compute and KV dtype; default: bfloat16 on cuda, float32 on cpu"})
    quantize: str = field(default="experts", metadata={
        "help": f"one of {QUANTIZE_MODES}: the frozen base as stored, MXFP4 routed experts, or every projection"})
    memory_mb: float = field(default=64.0, metadata={"help": "the engine's KV pages + KDA state slots, in MiB"})
    max_running: int | None = field(default=None, metadata={
        "help": "requests decoding at once; default: EngineConfig's", "type": int})
    max_seq_len: int | None = field(default=None, metadata={
        "help": "prompt + generated tokens of one request; default: EngineConfig's", "type": int})
    max_prefill_tokens: int | None = field(default=None, metadata={
        "help": "prompt tokens prefilled per engine step; default: EngineConfig's", "type": int})
    speculative: str = field(default="off", metadata={
        "help": f"one of {SPECULATIVE}: dspark drafts a block with --drafter and verifies it in one target "
                "forward (lossless: the same tokens and distribution as without)"})
    drafter: str | None = field(default=None, metadata={
        "help": "with --speculative dspark: a DSpark drafter directory (scripts/train_drafter.py writes one) or "
                "builtin:<name> (e.g. builtin:k3-tiny-steps/drafter)"})
    gamma: int | None = field(default=None, metadata={
        "help": "with --speculative: drafts per verify block; default: SpecConfig's", "type": int})
    spec_planner: str | None = field(default=None, metadata={
        "help": "with --speculative: verify_all or cost_aware (how many drafts a verify checks); default: "
                "SpecConfig's"})
    spec_max_batch: int | None = field(default=None, metadata={
        "help": "with --speculative: speculate only while at most this many requests decode together; larger "
                "batches decode one token a step; default: always speculate", "type": int})
    max_queued: int = field(default=256, metadata={
        "help": "samples that may wait for a decode slot beyond the max-running ones; past that, 429"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "after SIGINT/SIGTERM: seconds in-flight requests get to finish before they are aborted"})
    log_level: str = field(default="info", metadata={"help": f"one of {LOG_LEVELS}"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(tuple(a) for a in self.adapters))

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
    def model_name(self) -> str:
        return self.served_model_name if self.served_model_name is not None else self.model

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    def engine_overrides(self) -> dict:
        """The EngineConfig fields this config sets (the others keep EngineConfig's defaults)."""
        names = ("max_running", "max_seq_len", "max_prefill_tokens")
        fields = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if (spec := self.speculation()) is not None:
            fields["speculation"] = spec
        return fields

    def speculation(self):
        """EngineConfig.speculation for these flags: None (off) or a SpecConfig, which checks its fields
        (gamma and the planner keep SpecConfig's defaults when not given)."""
        if self.speculative == "off":
            return None
        from rollout.spec import SpecConfig

        given = {k: v for k, v in (("gamma", self.gamma), ("planner", self.spec_planner),
                                   ("max_batch", self.spec_max_batch)) if v is not None}
        try:
            return SpecConfig(drafter=Path(builtin_path(self.drafter)), **given)
        except ValueError as e:  # "SpecConfig.gamma must ..." -> the flag's name
            raise ValueError(str(e).replace("SpecConfig.planner", "--spec-planner")
                             .replace("SpecConfig.gamma", "--gamma")
                             .replace("SpecConfig.max_batch", "--spec-max-batch")) from None

    # ------------------------------------------------------------------- check
    def check(self) -> None:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"--{name.replace('_', '-')} {rule}, got {getattr(self, name)!r}")

        def int_at_least(name: str, low: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise fail(name, f"must be an integer >= {low}")

        def positive(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise fail(name, "must be a number > 0")

        if not isinstance(self.model, str) or not self.model:
            raise fail("model", f"must be a checkpoint directory or {BUILTIN_PREFIX}<name>")
        if not (self.model_path / "config.json").is_file():
            if self.model.startswith(BUILTIN_PREFIX):
                known = sorted(p.name for p in Path(builtin_path(BUILTIN_PREFIX)).iterdir() if p.is_dir())
                raise fail("model", f"names no embedded model; known: {[BUILTIN_PREFIX + k for k in known]}")
            raise fail("model", "must be a directory holding config.json (an HF checkpoint)")
        names = [name for name, _ in self.adapters]
        for name, path in self.adapters:
            if not name or "=" in name:
                raise fail("adapter", "entries must be NAME=PEFT_DIR with a non-empty NAME")
            if name == self.model_name:
                raise fail("adapter", f"name {name!r} is the base model's served name")
            if not Path(path).is_dir():
                raise ValueError(f"--adapter {name}={path}: no such directory")
        if len(set(names)) != len(names):
            raise fail("adapter", "names must be distinct")
        if self.tokenizer is not None and self.tokenizer not in TOKENIZERS:
            raise fail("tokenizer", f"must be one of {TOKENIZERS}")
        if self.served_model_name is not None and not self.served_model_name:
            raise fail("served_model_name", "must be non-empty")
        if self.device not in DEVICES:
            raise fail("device", f"must be one of {DEVICES}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise fail("dtype", f"must be one of {DTYPES}")
        if self.quantize not in QUANTIZE_MODES:
            raise fail("quantize", f"must be one of {QUANTIZE_MODES}")
        int_at_least("port", 0)
        if self.port > 65535:
            raise fail("port", "must be <= 65535")
        positive("memory_mb")
        for name in ("max_running", "max_seq_len", "max_prefill_tokens"):
            int_at_least(name, 1, optional=True)
        int_at_least("max_queued", 0)
        if isinstance(self.shutdown_timeout, bool) or not isinstance(self.shutdown_timeout, (int, float)) \
                or not self.shutdown_timeout >= 0:
            raise fail("shutdown_timeout", "must be a number >= 0")
        if self.log_level not in LOG_LEVELS:
            raise fail("log_level", f"must be one of {LOG_LEVELS}")
        if self.speculative not in SPECULATIVE:
            raise fail("speculative", f"must be one of {SPECULATIVE}")
        if (self.speculative != "off") != (self.drafter is not None):
            raise ValueError("--speculative dspark and --drafter go together")
        if self.drafter is not None and not (Path(builtin_path(self.drafter)) / "config.json").is_file():
            raise ValueError(f"--drafter {self.drafter}: no drafter here (config.json; scripts/train_drafter.py "
                             "writes one)")
        self.speculation()
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise fail("device", "is cuda but no CUDA device is available")
