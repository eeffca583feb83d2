"""The trainer's configuration: typed dataclasses that Hydra composes, validated in one place.

Hydra composes `recipes/` YAML onto `TrainConfig` (registered as the structured schema `miles_train_schema`),
so a misspelled key or a wrong type fails in OmegaConf with the key's path. `resolve(cfg)` then checks every
value and builds the frozen configs the components take (PolicyLossConfig, RewardConfig, PromptDataConfig,
LoraSpec, EngineConfig); every error is a ValueError that starts with the field's dotted path, and it runs
before any model is built.

Groups (one YAML file each under recipes/<group>/): model, parallel, algo, data, reward, cluster, logging;
`recipe=<name>` picks recipes/recipe/<name>.yaml, a global override of the others.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

BUILTIN_PREFIX = "builtin:"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
LAUNCHERS = ("local", "ray")
WANDB_MODES = ("offline", "online", "disabled")
TOKENIZERS = ("arithmetic", "hf")
RESUME_MODES = ("auto", "never")


# ------------------------------------------------------------------ schema (what YAML may set)
@dataclass
class ModelCfg:
    path: Optional[str] = "builtin:k3-tiny-arith"  # HF checkpoint dir, or builtin:<asset>; None: random init
    preset: Optional[str] = None  # random init from K3Config.from_preset (benchmarks); excludes path
    vocab_size: Optional[int] = None  # with preset: override (the arithmetic tokenizer has 18 ids)
    tokenizer: str = "arithmetic"  # TOKENIZERS; "hf" loads transformers.AutoTokenizer from path
    train_dtype: str = "float32"  # trainer base + LoRA dtype (bfloat16 on GPU)


@dataclass
class LoraCfg:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Optional[list[str]] = None  # regexes over HF module names; None: the default set


@dataclass
class ParallelCfg:
    tp: int = 1
    sp: bool = False  # sequence parallel over the TP group: norms / residual / AttnRes hold a slice of the tokens
    pp: int = 1
    cp: int = 1
    ep: int = 1


@dataclass
class RolloutCfg:
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_at_eos: bool = True
    quantize: str = "none"  # none | experts | all (the engine's base)
    mxfp4_matmul: str = "auto"  # auto | torch | triton: how the engine multiplies MXFP4 experts (auto: triton on CUDA)
    overlap: str = "auto"  # auto | on | off: enqueue decode step k+1 before reading step k (auto: on CUDA)
    compile_decode: bool = False  # torch.compile the engine's CUDA-graph decode step (CUDA, bf16)
    # Free the engine's KV / state pools (and its CUDA graphs, which read them by address) while the trainer
    # runs. false keeps them, and the graphs captured once serve every later step: for a device that holds
    # both (k3-small on one H200), where recapturing each step cost most of the rollout time.
    release_memory: bool = True
    dtype: str = "float32"
    memory_mb: float = 64.0  # KV pages + KDA state slots
    page_size: int = 16
    chunk_size: int = 64
    max_prefill_tokens: int = 512
    max_prefill_requests: int = 256  # requests packed into one prefill forward (token budget permitting)
    max_running: int = 256


@dataclass
class AlgoCfg:
    normalize_std: bool = True
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: Optional[float] = None
    ratio: str = "token"
    kl: str = "none"
    kl_coef: float = 0.0
    reducer: str = "token_mean"
    max_response_len: Optional[int] = None
    rollout_correction: str = "tis"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    mis_level: str = "token"
    opsm_delta: float = 1e-4
    dynamic_sampling: bool = True  # drop zero-variance groups, refill up to max_refill_rounds
    max_refill_rounds: int = 2
    updates_per_step: int = 1  # optimizer steps per rollout batch (minibatches)


@dataclass
class OptimCfg:
    lr: float = 2e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclass
class DataCfg:
    path: str = "builtin:k3-tiny-arith/train.jsonl"
    prompt_key: str = "prompt"
    label_key: Optional[str] = "label"
    metadata_keys: Optional[list[str]] = None  # None: every other key
    chat_template: Optional[str] = None
    system_prompt: Optional[str] = None
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    eval_path: Optional[str] = "builtin:k3-tiny-arith/heldout.jsonl"
    eval_max_prompts: Optional[int] = None  # None: all


@dataclass
class RewardCfg:
    fn: str = "arithmetic"
    timeout_s: float = 30.0
    on_failure: str = "raise"
    max_concurrency: int = 16
    url: Optional[str] = None
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ClusterCfg:
    launcher: str = "local"  # LAUNCHERS
    device: str = "cpu"  # DEVICES
    num_workers: int = 1  # trainer ranks (= parallel.tp for now); one engine per worker
    threads_per_worker: Optional[int] = None  # torch intra-op threads; None: torch's default
    ray_address: Optional[str] = None  # None: start a local Ray instance


@dataclass
class LoggingCfg:
    wandb: str = "offline"  # WANDB_MODES
    project: str = "miles-k3"
    run_name: Optional[str] = None
    progress: bool = True
    log_every: int = 1


@dataclass
class TrainerCfg:
    max_steps: int = 40
    seed: int = 0
    deterministic: bool = False
    save_every: int = 10  # steps; 0: only at the end
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | never | a checkpoint dir
    eval_every: int = 10  # steps; 0: only before and after
    eval_before: bool = True


@dataclass
class TrainConfig:
    model: ModelCfg = field(default_factory=ModelCfg)
    lora: LoraCfg = field(default_factory=LoraCfg)
    parallel: ParallelCfg = field(default_factory=ParallelCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    data: DataCfg = field(default_factory=DataCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
    logging: LoggingCfg = field(default_factory=LoggingCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    recipe: Optional[str] = None  # set by recipes/recipe/<name>.yaml (its name, for the run record)


def register_schema() -> None:
    """Make `TrainConfig` available to Hydra as the `miles_train_schema` defaults entry of recipes/train.yaml."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="miles_train_schema", node=TrainConfig)


# ------------------------------------------------------------------ validation
def builtin_path(value: str) -> str:
    """`builtin:<relative path>` -> a path inside the installed package's assets (other values unchanged)."""
    if value.startswith(BUILTIN_PREFIX):
        return str(ASSETS_DIR / value[len(BUILTIN_PREFIX):])
    return value


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything the run needs, validated. `raw` is the plain-dict form of the TrainConfig (for the run record)."""

    raw: dict[str, Any]
    model: ModelCfg
    lora: Any  # miles_k3.model.lora_spec.LoraSpec
    parallel: ParallelCfg
    rollout: RolloutCfg
    engine: Any  # rollout.engine.EngineConfig
    loss: Any  # miles_k3.algo.PolicyLossConfig
    algo: AlgoCfg
    optim: OptimCfg
    data: Any  # miles_k3.data.PromptDataConfig
    eval_data: Any  # PromptDataConfig | None
    eval_max_prompts: int | None
    reward: Any  # miles_k3.rewards.RewardConfig
    cluster: ClusterCfg
    logging: LoggingCfg
    trainer: TrainerCfg


class _Checker:
    def __init__(self, section: str, obj: Any):
        self.section, self.obj = section, obj

    def fail(self, name: str, rule: str) -> ValueError:
        return ValueError(f"{self.section}.{name} {rule}, got {getattr(self.obj, name)!r}")

    def int_at_least(self, name: str, low: int) -> None:
        v = getattr(self.obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(name, f"must be an integer >= {low}")

    def number(self, name: str, low: float | None = None, high: float | None = None, *, open_low: bool = False) -> None:
        v = getattr(self.obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(name, "must be a finite number")
        if low is not None and (v < low or (open_low and v == low)):
            raise self.fail(name, f"must be {'>' if open_low else '>='} {low}")
        if high is not None and v > high:
            raise self.fail(name, f"must be <= {high}")

    def choice(self, name: str, options: tuple[str, ...]) -> None:
        if getattr(self.obj, name) not in options:
            raise self.fail(name, f"must be one of {options}")


def _same_fields(component: type, section: Any) -> Any:
    """`component` (a frozen config with its own validation) from the schema section that mirrors its fields
    (AlgoCfg holds PolicyLossConfig's fields plus the loop's, RewardCfg holds RewardConfig's)."""
    return component(**{f.name: getattr(section, f.name) for f in fields(component)})


def _nested(section: str, build):
    """Run a component config's own validation and prefix its message with the section."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{section}: {e}") from None


def resolve(cfg: Any) -> ResolvedConfig:
    """Validate a composed config (DictConfig or TrainConfig) and build the component configs."""
    from omegaconf import OmegaConf

    if not isinstance(cfg, TrainConfig):
        try:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
        except Exception as e:  # OmegaConf's errors name the key; keep the message, drop the type zoo
            raise ValueError(f"config: {e}") from None
    raw = asdict(cfg)

    from miles_k3.algo import PolicyLossConfig
    from miles_k3.data import PromptDataConfig
    from miles_k3.model.config import PRESETS
    from miles_k3.model.lora_spec import LoraSpec
    from miles_k3.rewards import RewardConfig
    from rollout.config import MXFP4_MATMULS, OVERLAP_MODES, EngineConfig
    from rollout.model_runner import QUANTIZE_MODES

    m = _Checker("model", cfg.model)
    m.choice("tokenizer", TOKENIZERS)
    m.choice("train_dtype", DTYPES)
    if (cfg.model.path is None) == (cfg.model.preset is None):
        raise ValueError("model: set exactly one of model.path (a checkpoint) and model.preset (random init), "
                         f"got path={cfg.model.path!r}, preset={cfg.model.preset!r}")
    if cfg.model.preset is not None and cfg.model.preset not in PRESETS:
        raise m.fail("preset", f"must be one of {sorted(PRESETS)}")
    if cfg.model.path is not None:
        cfg.model.path = builtin_path(cfg.model.path)
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise m.fail("path", "must be a directory holding config.json (an HF checkpoint)")
        if cfg.model.vocab_size is not None:
            raise m.fail("vocab_size", "only applies with model.preset (a checkpoint fixes its vocabulary)")
    if cfg.model.vocab_size is not None:
        m.int_at_least("vocab_size", 2)
    if cfg.model.tokenizer == "hf" and cfg.model.path is None:
        raise m.fail("tokenizer", "'hf' needs model.path (the tokenizer is loaded from the checkpoint)")

    lora = _nested("lora", lambda: LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                            **({} if cfg.lora.targets is None else
                                               {"targets": tuple(cfg.lora.targets)})))

    p = _Checker("parallel", cfg.parallel)
    for name in ("tp", "pp", "cp", "ep"):
        p.int_at_least(name, 1)
    for name in ("pp", "cp", "ep"):
        if getattr(cfg.parallel, name) != 1:
            raise p.fail(name, "must be 1: only tensor parallelism (tp, sp) is implemented so far")
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        raise p.fail("sp", "needs parallel.tp > 1: sequence parallelism shards over the tensor-parallel group")

    r = _Checker("rollout", cfg.rollout)
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "page_size", "chunk_size",
                 "max_prefill_tokens", "max_prefill_requests", "max_running"):
        r.int_at_least(name, 1)
    if cfg.rollout.samples_per_prompt < 2:
        raise r.fail("samples_per_prompt", "must be >= 2 (group-normalized advantages need a group)")
    r.number("temperature", 0.0, open_low=True)
    r.number("memory_mb", 0.0, open_low=True)
    r.choice("quantize", QUANTIZE_MODES)
    r.choice("mxfp4_matmul", MXFP4_MATMULS)
    r.choice("overlap", OVERLAP_MODES)
    if cfg.rollout.compile_decode and (cfg.cluster.device != "cuda" or cfg.rollout.dtype != "bfloat16"):
        raise r.fail("compile_decode", "compiles the CUDA-graph decode step: needs cluster.device=cuda and "
                                       "rollout.dtype=bfloat16")
    if cfg.rollout.mxfp4_matmul == "triton":
        for ok, need in ((cfg.rollout.quantize != "none", "rollout.quantize=experts or all (MXFP4 experts)"),
                         (cfg.cluster.device == "cuda", "cluster.device=cuda"),
                         (cfg.rollout.dtype == "bfloat16", "rollout.dtype=bfloat16")):
            if not ok:
                raise r.fail("mxfp4_matmul", f"'triton' needs {need}")
    r.choice("dtype", DTYPES)
    engine = _nested("rollout", lambda: EngineConfig(
        memory_bytes=int(cfg.rollout.memory_mb * 2**20), page_size=cfg.rollout.page_size,
        chunk_size=cfg.rollout.chunk_size, max_prefill_tokens=cfg.rollout.max_prefill_tokens,
        max_prefill_requests=cfg.rollout.max_prefill_requests, max_running=cfg.rollout.max_running,
        mxfp4_matmul=cfg.rollout.mxfp4_matmul, overlap=cfg.rollout.overlap, compile_decode=cfg.rollout.compile_decode))

    a = cfg.algo
    loss = _nested("algo", lambda: _same_fields(PolicyLossConfig, a))
    ac = _Checker("algo", a)
    ac.int_at_least("max_refill_rounds", 0)
    ac.int_at_least("updates_per_step", 1)
    if a.updates_per_step > cfg.rollout.prompts_per_step:
        raise ac.fail("updates_per_step", f"must be <= rollout.prompts_per_step ({cfg.rollout.prompts_per_step}): "
                                          "each update takes whole groups")

    o = _Checker("optim", cfg.optim)
    o.number("lr", 0.0, open_low=True)
    o.number("weight_decay", 0.0)
    o.number("beta1", 0.0, 1.0)
    o.number("beta2", 0.0, 1.0)
    o.number("grad_clip", 0.0)
    o.int_at_least("warmup_steps", 0)

    d = cfg.data

    def data_config(path: str) -> Any:
        return PromptDataConfig(path=builtin_path(path), prompt_key=d.prompt_key, label_key=d.label_key,
                                metadata_keys="*" if d.metadata_keys is None else tuple(d.metadata_keys),
                                chat_template=d.chat_template, system_prompt=d.system_prompt, shuffle=d.shuffle,
                                seed=d.seed, drop_last=d.drop_last)

    data = _nested("data", lambda: data_config(d.path))
    eval_data = None if d.eval_path is None else _nested("data.eval_path", lambda: data_config(d.eval_path))
    for section, dc in (("data.path", data), ("data.eval_path", eval_data)):
        if dc is not None and not Path(dc.path).is_file():
            raise ValueError(f"{section}: prompt dataset not found: {dc.path}")
    if d.eval_max_prompts is not None:
        _Checker("data", d).int_at_least("eval_max_prompts", 1)

    reward = _nested("reward", lambda: _same_fields(RewardConfig, cfg.reward))

    c = _Checker("cluster", cfg.cluster)
    c.choice("launcher", LAUNCHERS)
    c.choice("device", DEVICES)
    c.int_at_least("num_workers", 1)
    if cfg.cluster.threads_per_worker is not None:
        c.int_at_least("threads_per_worker", 1)
    if cfg.cluster.num_workers != cfg.parallel.tp:
        raise c.fail("num_workers", f"must equal parallel.tp ({cfg.parallel.tp}): one trainer rank per worker, "
                                    "and data parallelism is not implemented yet")
    if cfg.cluster.ray_address is not None and cfg.cluster.launcher != "ray":
        raise c.fail("ray_address", "only applies with cluster.launcher=ray")

    lg = _Checker("logging", cfg.logging)
    lg.choice("wandb", WANDB_MODES)
    lg.int_at_least("log_every", 1)

    t = _Checker("trainer", cfg.trainer)
    t.int_at_least("max_steps", 1)
    t.int_at_least("save_every", 0)
    t.int_at_least("keep_checkpoints", 1)
    t.int_at_least("eval_every", 0)
    if cfg.trainer.resume not in RESUME_MODES and not Path(cfg.trainer.resume).is_dir():
        raise t.fail("resume", f"must be one of {RESUME_MODES} or an existing checkpoint directory")

    return ResolvedConfig(raw=raw, model=cfg.model, lora=lora, parallel=cfg.parallel, rollout=cfg.rollout,
                          engine=engine, loss=loss, algo=cfg.algo, optim=cfg.optim, data=data, eval_data=eval_data,
                          eval_max_prompts=d.eval_max_prompts, reward=reward, cluster=cfg.cluster,
                          logging=cfg.logging, trainer=cfg.trainer)
