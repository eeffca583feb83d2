"""`resolve`: a composed config, checked whole, as the frozen configs the run's components take.

Each section checks its own values (`Section.check`) and each component checks the fields it owns when it
is built here (LoraSpec, SamplingParams, EngineConfig, PolicyLossConfig, PromptDataConfig, RewardConfig);
`resolve` adds only the rules that span sections. Every error is a ValueError whose message starts with the
field's dotted path (`algo.eps_high must be >= 0, got -1.0`), raised before any model is built. The schema
itself: `miles_k3.trainer.config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable

from miles_k3.algo import PolicyLossConfig
from miles_k3.data import PromptDataConfig
from miles_k3.model.assets import builtin_path
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.rewards import RewardConfig
from miles_k3.trainer.backends import DRAFTER, ROLLOUT_BACKENDS, ROLLOUT_FN, backend_class
from miles_k3.trainer.config import (
    ENGINE_KEYS,
    AlgoCfg,
    ClusterCfg,
    LoggingCfg,
    ModelCfg,
    OptimCfg,
    ParallelCfg,
    RolloutCfg,
    TrainConfig,
    TrainerCfg,
)
from miles_k3.trainer.section import Section
from rollout.config import EngineConfig
from rollout.request import SamplingParams


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything the run needs, checked: the components' frozen configs and the trainer's own sections.
    `raw` is the plain-dict form of the TrainConfig (for the run record)."""

    raw: dict[str, Any]
    model: ModelCfg
    lora: LoraSpec
    parallel: ParallelCfg
    rollout: RolloutCfg  # the run's own rollout.* options (sampling and engine: below)
    sampling: SamplingParams
    engine: EngineConfig
    loss: PolicyLossConfig
    algo: AlgoCfg  # the loop's group options (the loss: above)
    optim: OptimCfg
    data: PromptDataConfig
    eval_data: PromptDataConfig | None
    eval_max_prompts: int | None
    reward: RewardConfig
    cluster: ClusterCfg
    logging: LoggingCfg
    trainer: TrainerCfg

    def engine_spec(self, device: str):
        """The colocated engine's `rollout.build.EngineSpec` on `device`: model.*'s base (initialized from
        trainer.seed), rollout.quantize and rollout.dtype, one adapter slot of the policy's LoraSpec, and the
        EngineConfig. The trainer hands it the base it has loaded: `build_engine(spec, base=(config, state))`."""
        from miles_k3.trainer.base import base_args
        from rollout.build import EngineSpec

        return EngineSpec(
            **base_args(self.model),
            seed=self.trainer.seed,
            quantize=self.rollout.quantize,
            dtype=self.rollout.dtype,
            device=device,
            lora=self.lora,
            max_adapters=1,
            tp=self.rollout.tp,
            ep=self.rollout.tp if self.rollout.ep else 1,
            dcp=self.rollout.dcp,
            engine=self.engine,
        )


def config_error(exc: Exception) -> str:
    """One line for an OmegaConf / Hydra composition error: the key's path and the first line of the reason
    (their messages run over several lines of reference and object types)."""
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    err = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
        key = err.full_key
        if isinstance(err, MissingMandatoryValue):
            return f"{key} must be set (it has no default), e.g. {key}=..."
        reason = str(getattr(err, "msg", err)).strip().splitlines()[0]
        return f"{key}: {reason}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    override = getattr(exc, "override", None)  # hydra's OverrideParseException: the override as typed
    if isinstance(override, str):
        text = f"cannot parse the override {override!r}: {text}"
    options = getattr(exc, "options", None)  # hydra's MissingConfigException: the group's files
    return text + (f" (available: {', '.join(options)})" if options else "")


def in_section(section: str, fn: Callable[[], Any], component: type | None = None) -> Any:
    """Run fn (a section's check, or building its component) and put the section's path on its ValueError:
    "<field> ..." and "<Component>.<field> ..." become "<section>.<field> ..."."""
    try:
        return fn()
    except ValueError as e:
        msg = str(e)
        if component is not None and msg.startswith(f"{component.__name__}."):
            msg = msg[len(component.__name__) + 1 :]
        if re.match(r"[a-z_][a-z0-9_]*\b", msg):
            raise ValueError(f"{section}.{msg}") from None
        raise ValueError(f"{section}: {msg}") from None


def unknown_keys(cfg: Any, schema: Any, prefix: str = "") -> None:
    """ValueError naming the first key of `cfg` (a mapping or DictConfig) that the schema instance `schema`
    (a dataclass, its sections nested) has no field for. OmegaConf refuses such keys on its own, except
    those added with Hydra's `+key=value`, which open the node: `to_object` would then drop them silently."""
    from omegaconf import OmegaConf

    if OmegaConf.is_dict(cfg):  # plain, unresolved: a missing value or an interpolation is not read here
        cfg = OmegaConf.to_container(cfg, resolve=False)
    names = {f.name for f in dataclasses.fields(schema)}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ValueError(f"{path}: no such key in the config (a typo, or a key of another section?)")
        sub = getattr(schema, key)
        if dataclasses.is_dataclass(sub) and isinstance(value, Mapping):
            unknown_keys(value, sub, f"{path}.")


def exact_rules(cfg: Any, lora: LoraSpec) -> None:
    """What rollout.exact asks of the rest of the config: one model replica per rank on both sides (a
    collective sums in its own order), the same weights and dtype in the engine as in the trainer, no LoRA
    dropout (the engine has none), and the forwards in the rank's own thread (`miles_k3.ops.exact`)."""
    r, par = cfg.rollout, cfg.parallel
    rules = [
        (r.backend == "colocated", "rollout.backend=colocated (servers elsewhere compute in their own order)"),
        (all(getattr(par, n) == 1 for n in ("tp", "pp", "cp", "ep")), "parallel.tp, pp, cp and ep = 1 (dp is fine)"),
        (r.tp == 1, "rollout.tp=1"),
        (r.quantize == "none", "rollout.quantize=none (an MXFP4 base is not the trainer's weights)"),
        (r.dtype == cfg.model.train_dtype, f"rollout.dtype equal to model.train_dtype ({cfg.model.train_dtype})"),
        (lora.dropout == 0.0, "lora.dropout=0"),
        (r.fn is None, "no rollout.fn (a plugin's threads would run the engine outside the exact numerics)"),
        (not r.compile_decode, "rollout.compile_decode=false"),
    ]
    for ok, need in rules:
        if not ok:
            raise ValueError(f"rollout.exact needs {need}")
    if cfg.cluster.device == "cpu" and cfg.cluster.launcher == "external":
        from miles_k3.ops.exact import cpu_env_missing

        # the local and Ray launchers start their ranks with it; an external world's ranks start as they are
        if missing := cpu_env_missing():
            raise ValueError(
                f"rollout.exact on CPU needs the ranks started with {' '.join(missing)} in the environment"
            )


# the rollout.* engine fields the disaggregated mode's servers take as flags (`engine_fleet.serve_flags`); any
# other one must keep EngineConfig's default
SERVER_ENGINE_KEYS = ("max_running", "max_prefill_tokens", "record_routing")


def disaggregated_rules(cfg: Any, engine: EngineConfig) -> None:
    """What cluster.mode=disaggregated asks of the rest of the config (`miles_k3.trainer.engine_fleet`): the HTTP
    backend over servers it starts itself from a checkpoint, with the engine settings its servers take."""
    r, c = cfg.rollout, cfg.cluster
    if r.backend != "http":
        raise ValueError(
            "cluster.mode=disaggregated drives its engine servers by SGLang's API: set rollout.backend=http"
        )
    if r.urls:
        raise ValueError("rollout.urls: cluster.mode=disaggregated starts the engine servers itself; leave it empty")
    if c.launcher != "local":
        raise ValueError(f"cluster.mode=disaggregated runs under cluster.launcher=local, got {c.launcher!r}")
    if cfg.model.path is None:
        raise ValueError("model.path: the engine servers load the base from a checkpoint (a random preset has none)")
    defaults = EngineConfig(memory_bytes=1)
    for name in ENGINE_KEYS:
        if name not in SERVER_ENGINE_KEYS and getattr(engine, name) != getattr(defaults, name):
            raise ValueError(f"rollout.{name}: the engine servers do not take it yet (cluster.mode=disaggregated)")
    if c.device == "cuda":
        import torch

        need = c.num_workers + c.engine_workers * r.tp
        if torch.cuda.device_count() < need:
            raise ValueError(
                f"cluster.engine_workers: {c.num_workers} trainer GPUs + {c.engine_workers} engines x rollout.tp "
                f"{r.tp} = {need} GPUs, this machine has {torch.cuda.device_count()}"
            )


def resolve(cfg: Any) -> ResolvedConfig:
    """Check a composed config (a DictConfig, a mapping or a TrainConfig) and build the component configs."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, Mapping) or OmegaConf.is_dict(cfg):
        unknown_keys(cfg, TrainConfig())
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    except OmegaConfBaseException as e:  # unknown key, wrong type, missing value
        raise ValueError(config_error(e)) from None
    raw = asdict(cfg)
    if cfg.model.path is not None:
        cfg.model.path = builtin_path(cfg.model.path)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, Section):
            in_section(f.name, section.check)

    r, a, c, d = cfg.rollout, cfg.algo, cfg.cluster, cfg.data
    lora = in_section("lora", lambda: LoraSpec(**cfg.lora.values()), LoraSpec)
    if cfg.lora.projector:
        raise ValueError(
            "lora.projector: LoRA on the vision projector is not built yet (the trainer does not "
            "recompute image features with grad, nor the engine take a projector adapter); set "
            "lora.projector=false (tower and projector frozen)"
        )
    sampling = in_section("rollout", r.sampling, SamplingParams)
    engine = in_section("rollout", r.engine, EngineConfig)
    loss = in_section("algo", a.loss, PolicyLossConfig)
    data = in_section("data", lambda: d.prompts(d.path), PromptDataConfig)
    eval_data = None if d.eval_path is None else in_section("data", lambda: d.prompts(d.eval_path), PromptDataConfig)
    reward = in_section("reward", lambda: RewardConfig(**cfg.reward.values()), RewardConfig)

    # rules that span sections
    if r.compile_decode and (c.device != "cuda" or r.dtype != "bfloat16"):
        raise ValueError(
            "rollout.compile_decode compiles the CUDA-graph decode step: needs cluster.device=cuda "
            "and rollout.dtype=bfloat16"
        )
    if r.mxfp4_matmul == "triton":
        for ok, need in (
            (r.quantize != "none", "rollout.quantize=experts or all (MXFP4 experts)"),
            (c.device == "cuda", "cluster.device=cuda"),
            (r.dtype == "bfloat16", "rollout.dtype=bfloat16"),
        ):
            if not ok:
                raise ValueError(f"rollout.mxfp4_matmul 'triton' needs {need}")
    if a.routing_replay == "rollout" and not r.record_routing:
        raise ValueError(
            "algo.routing_replay 'rollout' replays the experts the engine records: set rollout.record_routing=true"
        )
    if a.updates_per_step > r.prompts_per_step:
        raise ValueError(
            f"algo.updates_per_step must be <= rollout.prompts_per_step ({r.prompts_per_step}): "
            f"each update takes whole groups, got {a.updates_per_step}"
        )
    if d.chat_template in ("hf", "k3") and cfg.model.tokenizer != "hf":
        raise ValueError(
            f"data.chat_template {d.chat_template!r} renders with the checkpoint tokenizer's own chat encoding: "
            f"needs model.tokenizer=hf, got model.tokenizer={cfg.model.tokenizer!r}"
        )
    if d.chat_template == "chatml" and cfg.model.tokenizer == "hf":
        raise ValueError(
            "data.chat_template 'chatml' is the embedded models' built-in template; an HF checkpoint "
            "renders with its tokenizer's own: use data.chat_template=hf"
        )
    backend = backend_class(r.backend)  # what the rollout backend can do, before it is built
    for asked, field, capability in (
        (
            r.speculative.drafter is not None and r.speculative.distill_every,
            "rollout.speculative.distill_every",
            DRAFTER,
        ),
        (r.fn is not None, "rollout.fn", ROLLOUT_FN),
    ):
        if asked and capability not in backend.CAPABILITIES:
            able = sorted(k for k, v in ROLLOUT_BACKENDS.items() if capability in backend_class(k).CAPABILITIES)
            raise ValueError(
                f"{field} needs a rollout backend with {capability!r}; rollout.backend={r.backend!r} "
                f"runs {backend.__name__}, which has none (backends that do: {able})"
            )
    if c.mode == "disaggregated":
        disaggregated_rules(cfg, engine)
    elif r.backend == "http":
        if not r.urls:
            raise ValueError(
                "rollout.urls must list the servers' base URLs (http://host:port) with rollout.backend=http "
                "(or cluster.mode=disaggregated starts them)"
            )
        for name, default in (("tp", 1), ("dcp", 1), ("ep", False)):
            if getattr(r, name) != default:  # the servers' layout is their own flags
                raise ValueError(
                    f"rollout.{name} applies to colocated engines; with rollout.urls set it on the servers"
                )
    if r.backend == "http" and c.launcher == "ray":
        raise ValueError(
            "rollout.backend=http runs under cluster.launcher local or external (the Ray launcher's actors build "
            "colocated engines)"
        )
    if r.offload_weights and r.speculative.drafter is not None:
        raise ValueError(
            "rollout.offload_weights with rollout.speculative.drafter: the drafter's captured graphs read the "
            "target's embedding and head by address, which parking moves; keep the weights (offload_weights=false)"
        )
    if r.backend == "http":
        for name in ("offload_optimizer", "offload_base"):
            if getattr(cfg.parallel, name):
                raise ValueError(
                    f"parallel.{name} parks the trainer's state while colocated engines roll out; with "
                    "rollout.backend=http the engines are elsewhere and the trainer keeps its memory"
                )
    if c.launcher != "ray" and r.backend == "colocated":  # the engine's pools against this machine
        from miles_k3.errors import check_memory_mb

        check_memory_mb(r.memory_mb, c.device, "rollout.memory_mb")
    par = cfg.parallel
    if r.exact:
        exact_rules(cfg, lora)
    if c.num_workers != par.world_size:
        raise ValueError(
            f"cluster.num_workers must equal the layout's world size tp * pp * cp * dp = "
            f"{par.tp} * {par.pp} * {par.cp} * {par.dp} = {par.world_size} (one trainer rank per "
            f"worker), got {c.num_workers}"
        )
    if r.backend == "colocated" and c.num_workers % r.tp:
        raise ValueError(
            f"rollout.tp must divide cluster.num_workers ({c.num_workers}): every rank holds one shard of one "
            f"engine replica, got {r.tp}"
        )
    if r.tp > 1 and r.speculative.drafter is not None and r.speculative.distill_every:
        raise ValueError(
            f"rollout.speculative.distill_every distils the drafter of a one-rank engine: needs rollout.tp=1, "
            f"got {r.tp}"
        )
    groups_per_update = r.prompts_per_step // a.updates_per_step
    if groups_per_update < par.dp:
        raise ValueError(
            f"parallel.dp={par.dp} needs at least that many groups per update: rollout.prompts_per_step "
            f"({r.prompts_per_step}) / algo.updates_per_step ({a.updates_per_step}) = {groups_per_update}"
        )

    return ResolvedConfig(
        raw=raw,
        model=cfg.model,
        lora=lora,
        parallel=cfg.parallel,
        rollout=r,
        sampling=sampling,
        engine=engine,
        loss=loss,
        algo=a,
        optim=cfg.optim,
        data=data,
        eval_data=eval_data,
        eval_max_prompts=d.eval_max_prompts,
        reward=reward,
        cluster=c,
        logging=cfg.logging,
        trainer=cfg.trainer,
    )
