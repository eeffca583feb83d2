"""The Hydra schema of `miles-train`: `TrainConfig` and its sections (what recipes/ YAML and the command
line may set).

Hydra composes `recipes/` YAML onto `TrainConfig` (registered as the structured schema `miles_train_schema`),
so a misspelled key or a wrong type fails in OmegaConf with the key's path. A section that configures a
component takes that component's fields, types and defaults (`component_fields`: written once, in the
component): `lora.*` are LoraSpec's, `algo.*` PolicyLossConfig's plus the loop's group options, `data.*`
PromptDataConfig's plus the held-out set, `reward.*` RewardConfig's, and `rollout.*` holds SamplingParams'
and EngineConfig's fields beside the run's own. The trainer's own sections (model, parallel, optim, cluster,
logging, trainer) own their defaults and check themselves; `miles_k3.trainer.resolve` checks a composed
config whole and builds the components' frozen configs. Groups (one YAML file each under
recipes/<group>/): model, parallel, algo, data, reward, cluster, logging; `recipe=<name>` picks
recipes/recipe/<name>.yaml, a global override of the others.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, NamedTuple, Optional

from miles_k3.algo import PolicyLossConfig
from miles_k3.data import PromptDataConfig
from miles_k3.data.tokenizers import TOKENIZERS
from miles_k3.model.assets import builtin_path
from miles_k3.model.base import DTYPES
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.rewards import RewardConfig
from miles_k3.trainer.section import Check, Section, component_fields, field_names
from rollout.config import EngineConfig
from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.distill import DistillConfig
from rollout.spec.drafter import DSparkConfig

DEVICES = ("cpu", "cuda")
LAUNCHERS = ("local", "ray", "external")
MODES = ("colocated", "disaggregated")
WANDB_MODES = ("offline", "online", "disabled")
RESUME_MODES = ("auto", "never")
MAX_SEED = 2**63 - 2**16  # trainer.seed + rank must fit torch's int64 seed
# the rollout.* keys that are SamplingParams' / EngineConfig's fields (the others are the run's own)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
ROUTING_REPLAY = ("off", "rollout")  # algo.routing_replay
ENGINE_KEYS = (
    "state_fraction",
    "page_size",
    "chunk_size",
    "max_prefill_tokens",
    "max_prefill_requests",
    "max_running",
    "mxfp4_matmul",
    "overlap",
    "compile_decode",
    "record_routing",
)


@dataclass
class ModelCfg(Section):
    """model.*: the base the run trains (a checkpoint, or a random-init preset) and its tokenizer."""

    # an HF checkpoint directory, or builtin:<asset>; mandatory (a model group sets it: null with a preset)
    path: Optional[str] = "???"
    preset: Optional[str] = None  # random init from K3Config.from_preset (benchmarks), with path null
    vocab_size: Optional[int] = None  # with preset: override (the arithmetic tokenizer has 18 ids)
    tokenizer: str = "arithmetic"  # TOKENIZERS; "hf" loads transformers.AutoTokenizer from path
    train_dtype: str = "float32"  # DTYPES: the trainer's base + LoRA dtype (bfloat16 on GPU)

    def check(self) -> None:
        from miles_k3.model.config import PRESETS

        c = Check(self)
        c.choice("tokenizer", TOKENIZERS)
        c.choice("train_dtype", DTYPES)
        if (self.path is None) == (self.preset is None):
            raise ValueError(
                "path or preset must be set, not both (a checkpoint, or a random-init preset), "
                f"got path={self.path!r}, preset={self.preset!r}"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise c.fail("preset", f"must be one of {sorted(PRESETS)}")
        if self.path is not None:
            if not (Path(self.path) / "config.json").is_file():
                raise c.fail("path", "must be a directory holding config.json (an HF checkpoint)")
            if self.vocab_size is not None:
                raise c.fail("vocab_size", "only applies with model.preset (a checkpoint fixes its vocabulary)")
        if self.vocab_size is not None:
            c.int_at_least("vocab_size", 2)
        if self.tokenizer == "hf" and self.path is None:
            raise c.fail("tokenizer", "'hf' needs model.path (the tokenizer is loaded from the checkpoint)")


@dataclass
class LoraCfg(component_fields(LoraSpec)):
    """lora.*: LoraSpec's fields (rank, alpha, dropout, targets), its defaults and checks, and the run's own
    below."""

    # LoRA on the vision projector's two linears (mm_projector.proj.0 / proj.2) as well, for image prompts: the
    # trainer would recompute the features per step with grad and the engine take the projector's adapter.
    # Not built yet: true is refused at resolve. false: the tower and projector stay frozen, their features
    # computed once per prompt and shared by its rollouts and its training rows.
    projector: bool = False

    def values(self, names: tuple[str, ...] | None = None) -> dict:
        """LoraSpec's keyword arguments (of `names`, default all of LoraSpec's): `projector` is the run's."""
        return super().values(field_names(LoraSpec) if names is None else names)


@dataclass
class ParallelCfg(Section):
    """parallel.*: how the trainer's model is split over cluster.num_workers = tp * pp * cp * dp ranks (megatron's
    order: TP innermost, then CP, then DP, then PP); expert parallelism is formed inside dp * cp."""

    tp: int = 1  # tensor-parallel ranks (megatron-core column/row parallel linears)
    sp: bool = False  # sequence parallel over the TP group: norms / residual / AttnRes hold a slice of the tokens
    pp: int = 1  # pipeline stages (megatron's 1F1B schedule; the AttnRes bank travels packed with the residual)
    # decoder layers per stage, e.g. [11, 12, 12, 12, 12, 12, 12, 10] for 93 layers on 8; None: as even as possible
    pp_layers: Optional[List[int]] = None
    cp: int = 1  # context-parallel ranks: each holds 2 of 2*cp zigzag chunks of every packed row
    ep: int = 1  # expert-parallel ranks: each holds num_experts / ep routed experts (needs tp 1)
    dp: int = 1  # data-parallel replicas: each trains on its share of every minibatch's groups
    # packed tokens per micro-batch (whole sequences; a longer one is a micro-batch of its own); None: one
    # micro-batch per rank and minibatch. Pipelines want several micro-batches per stage to fill the 1F1B schedule.
    micro_batch_tokens: Optional[int] = None
    # recompute each decoder layer's activations in backward instead of keeping them (activation
    # checkpointing): memory for long micro-batches at the price of a second forward per layer
    recompute: bool = False
    # while the engines roll out, keep on the host: the optimizer's state (AdamW's two moments of every adapter
    # parameter) / the trainer's frozen base weights (back on the device for each update; `miles-k3 plan` says
    # when a layout needs them)
    offload_optimizer: bool = False
    offload_base: bool = False

    def check(self) -> None:
        c = Check(self)
        for name in ("tp", "pp", "cp", "ep", "dp"):
            c.int_at_least(name, 1)
        if self.sp and self.tp == 1:
            raise c.fail("sp", "needs parallel.tp > 1: sequence parallelism shards over the tensor-parallel group")
        if self.ep > 1 and self.tp > 1:
            raise c.fail("ep", "needs parallel.tp=1: the routed experts run with expert tensor parallelism 1")
        if (self.dp * self.cp) % self.ep:
            raise c.fail(
                "ep",
                f"must divide dp * cp = {self.dp * self.cp}: expert parallelism is formed inside the "
                f"data x context parallel ranks",
            )
        if self.pp_layers is not None:
            counts = list(self.pp_layers)
            if len(counts) != self.pp or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
                raise c.fail("pp_layers", f"must list parallel.pp={self.pp} layer counts, each an integer >= 1")
        if self.micro_batch_tokens is not None:
            c.int_at_least("micro_batch_tokens", 1)

    @property
    def world_size(self) -> int:
        """The trainer ranks this layout needs (cluster.num_workers must equal it)."""
        return self.tp * self.pp * self.cp * self.dp


def _renamed(build, component: type, prefix: str = ""):
    """build(); a ValueError "<Component>.<field> ..." becomes "<prefix><field> ..." (the schema's name)."""
    try:
        return build()
    except ValueError as e:
        msg, head = str(e), f"{component.__name__}."
        raise ValueError(prefix + msg[len(head) :] if msg.startswith(head) else msg) from None


@dataclass
class SpeculativeCfg(component_fields(SpecConfig, ("gamma", "planner", "max_batch"))):
    """rollout.speculative.*: DSpark speculation in the rollout engine (lossless: each sample's tokens and
    log-probs follow the policy with or without it, only faster) and the online distillation that keeps the
    drafter in step with the policy as RL moves it. Off unless `drafter` is set. `gamma`, `planner` and
    `max_batch` (speculate only in batches that small: a rollout's tail) are SpecConfig's (its defaults and
    checks); the distill_* fields are DistillConfig's, under the trainer's names (its defaults and checks)."""

    # a DSpark drafter directory (config.json + model.safetensors, written by scripts/train_drafter.py), or
    # builtin:<asset>/drafter; None: no speculation
    drafter: Optional[str] = None
    # every N steps, after the update, distil the drafter on that step's rollouts against the policy with its
    # new adapter (the engine's own target), in place; 0: never (the drafter stays as loaded)
    distill_every: int = 0
    distill_steps: int = DistillConfig.steps  # optimizer steps per distillation
    distill_lr: float = DistillConfig.lr  # AdamW learning rate of the drafter (its optimizer persists)
    distill_blocks: int = DistillConfig.blocks  # blocks (anchor + next gamma tokens) per optimizer step
    distill_decay: float = DistillConfig.decay  # loss weight ratio of each later block position

    def check(self) -> None:
        c = Check(self)
        c.int_at_least("distill_every", 0)
        _renamed(self.distill, DistillConfig, "distill_")
        if self.drafter is None:
            if self.distill_every:
                raise c.fail("distill_every", "needs rollout.speculative.drafter (the drafter to distil)")
            return
        path = Path(builtin_path(self.drafter))
        if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
            raise c.fail(
                "drafter",
                "must be a DSpark drafter directory holding config.json and model.safetensors "
                "(scripts/train_drafter.py writes one)",
            )
        try:
            block = DSparkConfig(**json.loads((path / "config.json").read_text())).block_size
        except (TypeError, ValueError) as e:
            raise c.fail(
                "drafter", f"holds no DSpark drafter config: {path / 'config.json'}: {str(e).splitlines()[0]}"
            ) from None
        self.spec()
        if self.gamma > block:
            raise c.fail("gamma", f"must be <= the drafter's block_size ({block})")

    def spec(self) -> SpecConfig | None:
        """What EngineConfig.speculation takes (None: off)."""
        if self.drafter is None:
            return None
        return _renamed(
            lambda: SpecConfig(
                drafter=builtin_path(self.drafter), gamma=self.gamma, planner=self.planner, max_batch=self.max_batch
            ),
            SpecConfig,
        )

    def distill(self) -> DistillConfig:
        return DistillConfig(
            steps=self.distill_steps, lr=self.distill_lr, blocks=self.distill_blocks, decay=self.distill_decay
        )


@dataclass
class RolloutCfg(component_fields(EngineConfig, ENGINE_KEYS), component_fields(SamplingParams, SAMPLING_KEYS)):
    """rollout.*: SamplingParams' sampling fields and EngineConfig's scheduling fields (their defaults and
    checks), and the run's own below."""

    prompts_per_step: int = 32  # groups (prompts) per GRPO step
    samples_per_prompt: int = 8  # group size n (>= 2: group-normalized advantages need a group)
    stop_at_eos: bool = True  # a sample ends at the tokenizer's eos (else at max_new_tokens)
    quantize: str = "none"  # the engine's base: none (the trainer's weights) | experts | all (MXFP4)
    dtype: str = "float32"  # DTYPES: the engine's base and KV dtype
    memory_mb: float = 64.0  # the engine's KV pages + KDA state slots (EngineConfig.memory_bytes, in MiB)
    # Free the engine's KV / state pools (and its CUDA graphs, which read them by address) while the trainer
    # runs. false keeps them, and the graphs captured once serve every later step: for a device that holds
    # both (k3-small on one H200), where recapturing each step cost most of the rollout time. With
    # rollout.backend=http it asks the servers (/release_memory_occupation: servers on the trainer's GPUs); with
    # rollout.max_staleness > 0 generation runs while the trainer trains, so nothing is released.
    release_memory: bool = True
    # A rollout plugin "module.path:function" (multi-turn / tool use: miles_k3.trainer.rollout_plugin) that
    # rolls out each sample against the policy and returns its tokens, loss mask and the engine's log-probs;
    # None: one generation per sample
    fn: Optional[str] = None
    # how rollout.fn reaches the policy: engine (the colocated engine in-process) | http (miles-serve's app
    # over the same engine on 127.0.0.1, SGLang's /generate and the OpenAI API)
    client: str = "engine"
    # speculative decoding in the engine and the drafter's online distillation (off by default)
    speculative: SpeculativeCfg = field(default_factory=SpeculativeCfg)
    # The engine's own layout, independent of parallel.* (as `miles-k3 generate --tp/--dcp/--ep`): each engine
    # replica is tp consecutive ranks, cluster.num_workers / tp replicas, one shard on every trainer rank's
    # device; dcp ranks per decode-context-parallel group inside a replica (divides tp); ep: whole routed
    # experts, num_experts / tp per rank (else split by their intermediate dim)
    tp: int = 1
    dcp: int = 1
    ep: bool = False
    # while the trainer trains, keep the engine's weights on the host too (with release_memory's pools)
    offload_weights: bool = False
    # where the engines are: colocated (a shard on every trainer rank, the layout above) | http (servers at
    # rollout.urls: miles-serve processes or an SGLang deployment, driven by SGLang's API)
    backend: str = "colocated"
    urls: List[str] = field(default_factory=list)
    # with rollout.backend=http, how each adapter version reaches the servers: null sends the PEFT file in the
    # request (/load_lora_adapter_from_tensors: miles-serve); a directory on a filesystem the servers share
    # writes it there and names it (/load_lora_adapter with lora_path: what an SGLang deployment reads)
    adapter_dir: Optional[str] = None
    # asynchrony: 0 is the on-policy loop (generate, then train); k > 0 lets generation run up to k adapter
    # versions ahead of training (the next steps' rollouts while this one trains; needs rollout.backend=http,
    # whose servers keep the last k + 1 versions loaded: miles-serve --max-loras >= k + 2)
    max_staleness: int = 0
    # what an adapter update does to rollouts in flight (with max_staleness > 0): off (they finish under the
    # version that began them) | restart (aborted and drawn again by the new version) | continue (aborted and
    # continued from their tokens by the new version; each token tagged with the version that drew it)
    partial: str = "off"
    # exact mode: the engine samples each token with log-probs bit-identical to the trainer's for it (fp32 or
    # bf16), whatever its batch, cache path or speculation: both compute in one row-invariant order
    # (miles_k3.ops.exact), at a cost in speed; the train/rollout gap is then exactly 0
    exact: bool = False

    def check(self) -> None:
        from miles_k3.trainer.rollout_plugin import CLIENTS
        from rollout.model_runner import QUANTIZE_MODES

        c = Check(self)
        c.choice("client", CLIENTS)
        if self.fn is not None and ":" not in self.fn:
            raise c.fail("fn", "must be 'module.path:function' (a rollout plugin) or null")
        if self.client != "engine" and self.fn is None:
            raise c.fail("client", "only applies with rollout.fn (a rollout plugin)")
        c.int_at_least("prompts_per_step", 1)
        c.int_at_least("samples_per_prompt", 2)
        c.number("temperature", 0.0, open_low=True)  # the trainer's log-probs divide by it: no greedy training
        c.number("memory_mb", 0.0, open_low=True)
        c.choice("quantize", QUANTIZE_MODES)
        c.choice("dtype", DTYPES)
        c.int_at_least("tp", 1)
        c.int_at_least("dcp", 1)
        if self.tp % self.dcp:
            raise c.fail("dcp", f"must divide rollout.tp ({self.tp}): DCP groups split an engine replica's ranks")
        if self.ep and self.tp == 1:
            raise c.fail("ep", "needs rollout.tp > 1: expert parallelism runs over an engine replica's ranks")
        from miles_k3.trainer.backends import ROLLOUT_BACKENDS

        c.choice("backend", tuple(ROLLOUT_BACKENDS))
        if self.backend == "http":
            # (no URLs at all: cluster.mode=disaggregated starts the servers, which resolve checks)
            if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls):
                raise c.fail("urls", "must list the servers' base URLs (http://host:port) with rollout.backend=http")
            if self.offload_weights:
                raise c.fail("offload_weights", "applies to colocated engines (the servers' memory is their own)")
        elif self.urls:
            raise c.fail("urls", "only applies with rollout.backend=http")
        if self.adapter_dir is not None and self.backend != "http":
            raise c.fail("adapter_dir", "only applies with rollout.backend=http")
        c.int_at_least("max_staleness", 0)
        c.choice("partial", ("off", "restart", "continue"))
        if self.partial != "off" and not self.max_staleness:
            raise c.fail(
                "partial", "applies with rollout.max_staleness > 0: only then are rollouts in flight at an update"
            )
        if self.max_staleness and self.backend != "http":
            raise c.fail(
                "max_staleness",
                "> 0 needs rollout.backend=http: colocated engines share the trainer's devices and processes, so "
                "generation cannot run while the trainer trains",
            )
        if self.offload_weights and not self.release_memory:
            raise c.fail("offload_weights", "needs rollout.release_memory=true: the weights go with the pools")
        try:
            self.speculative.check()
        except ValueError as e:  # "<field> ..." of the subsection: resolve puts "rollout." in front
            raise ValueError(f"speculative.{e}") from None

    def sampling(self) -> SamplingParams:
        """The sampling parameters of every training sample (the loop adds its seed and stop token)."""
        return SamplingParams(**self.values(SAMPLING_KEYS))

    def engine(self) -> EngineConfig:
        """The engine's config; exact mode decodes eagerly (no CUDA graphs: each step's ops as the trainer's)."""
        return EngineConfig(
            memory_bytes=int(self.memory_mb * 2**20),
            speculation=self.speculative.spec(),
            cuda_graphs=not self.exact,
            **self.values(ENGINE_KEYS),
        )


@dataclass
class AlgoCfg(component_fields(PolicyLossConfig)):
    """algo.*: PolicyLossConfig's fields (its defaults, which are GRPO's, and its checks), and the loop's
    group options below."""

    normalize_std: bool = True  # divide group-centered rewards by the group's std (GRPO); false: Dr.GRPO
    dynamic_sampling: bool = True  # drop zero-variance groups, refill up to max_refill_rounds (DAPO)
    max_refill_rounds: int = 2  # extra sampling rounds per step that refill dropped groups
    updates_per_step: int = 1  # optimizer steps per rollout batch (minibatches of whole groups)
    # "rollout": every trainer forward routes each token to the experts the engine chose while sampling it
    # (rollout routing replay, R3), its gate weights from the trainer's own scores; "off": the trainer's
    # routers choose (with rollout.record_routing the step still logs how often they agree with the engine's)
    routing_replay: str = "off"

    def check(self) -> None:
        c = Check(self)
        c.int_at_least("max_refill_rounds", 0)
        c.int_at_least("updates_per_step", 1)
        c.choice("routing_replay", ROUTING_REPLAY)

    def loss(self) -> PolicyLossConfig:
        return PolicyLossConfig(**self.values(field_names(PolicyLossConfig)))


@dataclass
class OptimCfg(Section):
    """optim.*: AdamW over the adapter parameters."""

    lr: float = 2e-3  # peak learning rate (> 0)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's first-moment decay, in [0, 1]
    beta2: float = 0.99  # AdamW's second-moment decay, in [0, 1]
    grad_clip: float = 1.0  # max global gradient norm; 0: measure, do not clip
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps to lr; 0: none

    def check(self) -> None:
        c = Check(self)
        c.number("lr", 0.0, open_low=True)
        c.number("weight_decay", 0.0)
        c.number("beta1", 0.0, 1.0)
        c.number("beta2", 0.0, 1.0)
        c.number("grad_clip", 0.0)
        c.int_at_least("warmup_steps", 0)


@dataclass
class DataCfg(component_fields(PromptDataConfig)):
    """data.*: PromptDataConfig's fields for the training prompts (the held-out prompts share every option
    but the path), and the held-out set below.

    data.chat_template: "hf" renders prompts (strings as one user message, or chat-message lists) with the
    checkpoint tokenizer's own template (`apply_chat_template` of its tokenizer config on disk, with the
    generation prompt; needs model.tokenizer=hf); None uses the prompt string verbatim (the embedded models'
    bare problems, or a dataset already templated offline); "chatml" is the built-in ChatML template, kept
    for the embedded tiny models only (model.tokenizer=arithmetic: an HF checkpoint uses its own, "hf"); any
    other string is a format string with {prompt} (and {system}). "k3" is K3's own chat encoding
    (`miles_k3.data.k3_chat`; needs model.tokenizer=hf and a tokenizer with K3's structure tokens): prompts are
    rendered straight to ids (the checkpoint tokenizer's own renderer when it has one), with the row's tools
    (data.tools_key) and the think channel opened or not (data.thinking); generation stops at the checkpoint's
    end-of-turn token (generation_config.json's eos), and the reward reads the reply's response channel
    (`Sample.response`), its reasoning (`Sample.reasoning`) and tool calls (`Sample.tool_calls`). A bad pairing
    with model.tokenizer is one ValueError naming data.chat_template."""

    eval_path: Optional[str] = None  # held-out prompts for the greedy evaluation; None: no evaluation
    eval_max_prompts: Optional[int] = None  # evaluate on the first N held-out prompts; None: all

    def check(self) -> None:
        if self.eval_max_prompts is not None:
            Check(self).int_at_least("eval_max_prompts", 1)

    def prompts(self, path: str) -> PromptDataConfig:
        """The training prompts' config (path: data.path) or the held-out prompts' (data.eval_path)."""
        return PromptDataConfig(**{**self.values(field_names(PromptDataConfig)), "path": builtin_path(path)})


@dataclass
class RewardCfg(component_fields(RewardConfig)):
    """reward.*: RewardConfig's fields (fn, timeout, failure policy, remote options), its defaults and checks."""


class Rendezvous(NamedTuple):
    """One rank of a world started by someone else (cluster.launcher=external): where it sits and where rank 0
    listens."""

    rank: int
    world_size: int
    local_rank: int  # this rank's index on its node (its GPU with cluster.device=cuda)
    master_addr: str
    master_port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu[07-09,12],cpu3" -> "gpu07" (zero padding kept)."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if head is None or not (head.group(1) or head.group(2)):
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
    prefix, ranges, suffix = head.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return prefix + first + suffix


# With cluster.launcher=external each process is one rank; its place comes from torchrun's variables, else
# from srun's. rank 0's address: MASTER_ADDR, else the first host of the step's (or job's) node list; the
# port: MASTER_PORT, else one derived from the job id (the same on every rank, distinct between jobs).
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SRUN = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def rendezvous_from_env(env: Mapping[str, str]) -> Rendezvous:
    """This process's place in an externally started world (ValueError naming the variable that is missing
    or malformed)."""
    names = _TORCHRUN if "RANK" in env else _SRUN
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(
            "cluster.launcher 'external' runs one rank per process, started by srun (SLURM_PROCID, "
            "SLURM_NTASKS, SLURM_LOCALID) or torchrun (RANK, WORLD_SIZE, LOCAL_RANK); missing "
            f"{', '.join(missing)}: use cluster.launcher=local to start the ranks here"
        )
    try:
        rank, world, local = (int(env[n]) for n in names)
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000
    except ValueError as e:
        raise ValueError(f"cluster.launcher 'external': a rank variable is not an integer ({e})") from None
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodes is None:
            raise ValueError("cluster.launcher 'external': no MASTER_ADDR and no SLURM_JOB_NODELIST to find rank 0")
        addr = first_host(nodes)
    return Rendezvous(rank, world, local, addr, port)


@dataclass
class ClusterCfg(Section):
    """cluster.*: where the workers run."""

    # LAUNCHERS: local (this process, or num_workers processes it starts on this machine), ray (Ray actors in a
    # placement group), external (this process is one rank of a world that srun or torchrun started: its rank,
    # world size and rank 0's address come from the environment; scripts/slurm/train_multinode.sbatch)
    launcher: str = "local"
    # MODES: colocated (the engines on the trainer's ranks, or servers at rollout.urls) | disaggregated (the
    # launcher starts engine_workers engine servers on devices of their own and restarts any that dies;
    # miles_k3.trainer.engine_fleet)
    mode: str = "colocated"
    engine_workers: int = 1  # with mode=disaggregated: engine replicas, each a server of rollout.tp ranks
    device: str = "cpu"  # DEVICES
    num_workers: int = 1  # trainer ranks (= parallel.world_size: tp * pp * cp * dp)
    threads_per_worker: Optional[int] = None  # torch intra-op threads; None: torch's default
    ray_address: Optional[str] = None  # with launcher=ray: the cluster to join; None: start a local Ray instance
    # with launcher=ray: seconds to wait for the cluster to hold every bundle (nodes still joining); then a
    # ValueError names the resources missing
    ray_placement_timeout_s: float = 600.0

    def check(self) -> None:
        c = Check(self)
        c.choice("launcher", LAUNCHERS)
        c.choice("mode", MODES)
        c.int_at_least("engine_workers", 1)
        if self.engine_workers != 1 and self.mode != "disaggregated":
            raise c.fail("engine_workers", "only applies with cluster.mode=disaggregated")
        c.choice("device", DEVICES)
        c.int_at_least("num_workers", 1)
        c.number("ray_placement_timeout_s", 0.0, open_low=True)
        if self.threads_per_worker is not None:
            c.int_at_least("threads_per_worker", 1)
        if self.ray_address is not None and self.launcher != "ray":
            raise c.fail("ray_address", "only applies with cluster.launcher=ray")
        if self.launcher == "external":
            world = self.rendezvous().world_size
            if world != self.num_workers:
                raise c.fail("num_workers", f"must equal the world the launcher started ({world} processes)")

    def rendezvous(self, env: Mapping[str, str] | None = None) -> Rendezvous:
        """With launcher=external: this process's rank and rank 0's address (`rendezvous_from_env`)."""
        return rendezvous_from_env(os.environ if env is None else env)


@dataclass
class LoggingCfg(Section):
    """logging.*: metrics.jsonl is always written; these add wandb and the console."""

    wandb: str = "offline"  # WANDB_MODES; online needs a W&B login (WANDB_API_KEY or `wandb login`)
    project: str = "miles-k3"  # the wandb project
    run_name: Optional[str] = None  # the wandb run name; None: the run directory's name
    progress: bool = True  # a console progress bar (a log line per step either way)
    log_every: int = 1  # write a metrics row every N steps (and at the last)

    def check(self) -> None:
        c = Check(self)
        c.choice("wandb", WANDB_MODES)
        c.int_at_least("log_every", 1)


@dataclass
class TrainerCfg(Section):
    """trainer.*: the run's length, seeds, evaluation and checkpoint schedule."""

    max_steps: int = 40  # GRPO steps
    seed: int = 0  # torch seed per rank (seed + rank) and the root of every sample's engine seed
    deterministic: bool = False  # torch.use_deterministic_algorithms (a resumed run reproduces exactly)
    save_every: int = 10  # steps between checkpoints; 0: only at the end
    keep_checkpoints: int = 2  # the newest N checkpoints are kept
    resume: str = "auto"  # auto (the newest good checkpoint of the run directory) | never | a checkpoint dir
    eval_every: int = 10  # steps between evaluations; 0: only before and after
    eval_before: bool = True  # evaluate once before the first step

    def check(self) -> None:
        c = Check(self)
        c.int_at_least("max_steps", 1)
        c.int_at_least("seed", 0)
        if self.seed > MAX_SEED:
            raise c.fail("seed", f"must be <= 2**63 - 2**16 = {MAX_SEED} (seed + rank seeds torch's int64 generator)")
        c.int_at_least("save_every", 0)
        c.int_at_least("keep_checkpoints", 1)
        c.int_at_least("eval_every", 0)
        if self.resume not in RESUME_MODES and not Path(self.resume).is_dir():
            raise c.fail("resume", f"must be one of {RESUME_MODES} or an existing checkpoint directory")


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


def compose_recipe(*overrides: str):
    """The run's config as `miles-train` composes it from the installed recipes (Hydra's compose API), before
    `resolve`: for scripts and tests that build a run's config without the command."""
    from hydra import compose, initialize_config_module

    register_schema()
    with initialize_config_module(config_module="recipes", version_base=None):
        return compose(config_name="train", overrides=list(overrides))
