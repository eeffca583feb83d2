"""Hydra composition of the shipped recipes, the schema typed by the components (one source per default),
and whole-config validation (errors name the field)."""

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from miles_k3.algo import PolicyLossConfig
from miles_k3.data import PromptDataConfig
from miles_k3.model.lora_spec import DEFAULT_TARGETS, LoraSpec
from miles_k3.rewards import RewardConfig
from miles_k3.trainer.base import load_base_config
from miles_k3.trainer.config import ENGINE_KEYS, SAMPLING_KEYS, TrainConfig
from miles_k3.trainer.resolve import resolve
from rollout.config import EngineConfig
from rollout.request import SamplingParams
from tests.trainer.recipes import composed


def defaults(cls, names=None):
    out = {}
    for f in dataclasses.fields(cls):
        if names is None or f.name in names:
            out[f.name] = (
                f.default
                if f.default is not dataclasses.MISSING
                else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "???")
            )
    return out


def test_schema_sections_take_the_components_fields_and_defaults():
    schema = TrainConfig()
    for section, component, names in [
        ("lora", LoraSpec, None),
        ("algo", PolicyLossConfig, None),
        ("data", PromptDataConfig, None),
        ("reward", RewardConfig, None),
        ("rollout", SamplingParams, SAMPLING_KEYS),
        ("rollout", EngineConfig, ENGINE_KEYS),
    ]:
        node = getattr(schema, section)
        assert {k: getattr(node, k) for k in defaults(component, names)} == defaults(component, names), section
    assert schema.data.path == "???" and schema.reward.fn == "???"  # mandatory: no component default


def test_default_recipe_resolves_to_the_embedded_run():
    rc = resolve(composed("recipe=k3_grpo"))
    assert rc.model.path.endswith("k3-tiny-arith") and rc.reward.fn == "arithmetic"
    assert rc.data.path.endswith("train.jsonl") and rc.eval_data.path.endswith("heldout.jsonl")
    assert rc.loss == PolicyLossConfig()  # recipes/algo/grpo.yaml sets nothing: GRPO is the default
    assert rc.loss.rollout_correction == "tis" and rc.loss.eps_high == 0.28
    assert rc.lora == LoraSpec() and rc.lora.targets == DEFAULT_TARGETS
    assert rc.engine == EngineConfig(memory_bytes=64 << 20, max_running=256, record_routing=True)
    assert rc.algo.routing_replay == "rollout"  # the K3 recipes replay the engine's routing (docs/design.md)
    assert rc.sampling == SamplingParams(max_new_tokens=6)
    assert rc.data.metadata_keys is None and rc.reward.timeout_s == 10.0


def test_user_keys_reach_the_components():
    rc = resolve(
        composed(
            "recipe=k3_grpo",
            "algo.eps_high=0.3",
            "rollout.top_p=0.9",
            "rollout.top_k=5",
            "lora.rank=4",
            "lora.targets=[q_proj$,o_proj$]",
            "data.metadata_keys=[src]",
            "rollout.page_size=32",
            "reward.headers={}",
        )
    )
    assert rc.loss.eps_high == 0.3 and rc.sampling.top_p == 0.9 and rc.sampling.top_k == 5
    assert rc.lora.rank == 4 and rc.lora.targets == ("q_proj$", "o_proj$")  # a list becomes the tuple
    assert rc.data.metadata_keys == ("src",) and rc.engine.page_size == 32
    assert rc.lora.scale == 16.0 / 4


def test_groups_swap_and_interpolate():
    rc = resolve(composed("recipe=k3_grpo", "algo=dr_grpo", "rollout.max_new_tokens=7"))
    assert rc.loss.reducer == "dr_grpo" and rc.loss.max_response_len == 7 and rc.loss.kl == "k3"
    assert rc.loss.eps_high == 0.2 and rc.loss.rollout_correction == "tis" and not rc.algo.normalize_std
    rc = resolve(composed("recipe=k3_grpo", "algo=gspo"))
    assert (rc.loss.ratio, rc.loss.reducer, rc.loss.eps_low) == ("gspo", "sequence_mean", 3.0e-4)
    assert resolve(composed("recipe=k3_grpo", "parallel=tp2", "parallel.sp=true", "cluster.num_workers=2")).parallel.sp
    rc = resolve(composed("recipe=k3_grpo", "model=k3_small", "cluster=gpu_single"))
    assert rc.model.preset == "k3-small" and rc.model.path is None and rc.cluster.device == "cuda"
    rc = resolve(composed("recipe=k3_small_gpu"))
    assert resolve(composed("recipe=k3_small_gpu", "rollout.mxfp4_matmul=triton")).engine.mxfp4_matmul == "triton"
    with pytest.raises(ValueError, match="rollout.mxfp4_matmul 'triton' needs cluster.device=cuda"):
        resolve(composed("recipe=k3_small_gpu", "rollout.mxfp4_matmul=triton", "cluster=local_cpu"))
    assert rc.model.train_dtype == "bfloat16" and rc.rollout.quantize == "experts" and rc.lora.rank == 16
    config = load_base_config(rc.model)  # k3-small at the task's 32-id vocabulary takes the task's special ids
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (32, 0, 1, 2)
    assert rc.raw["algo"]["dynamic_sampling"] is False  # random init: every group has zero reward variance
    assert rc.engine.max_prefill_requests == 256 and rc.raw["rollout"]["release_memory"] is False
    assert rc.sampling.max_new_tokens == 16 and rc.engine.max_running == 256


def test_the_engine_spec_is_the_runs_engine():
    """What the rollout worker builds (`rollout.build.build_engine(rc.engine_spec(device), base=...)`)."""
    rc = resolve(composed("recipe=k3_small_gpu"))
    spec = rc.engine_spec("cuda:0")
    assert (spec.preset, spec.vocab_size, spec.seed, spec.path) == ("k3-small", 32, rc.trainer.seed, None)
    assert spec.base_config() == load_base_config(rc.model)
    assert (spec.quantize, spec.dtype, spec.lora, spec.max_adapters, spec.engine) == (
        "experts",
        rc.rollout.dtype,
        rc.lora,
        1,
        rc.engine,
    )
    rc = resolve(composed("recipe=k3_grpo"))
    assert rc.engine_spec("cpu").path == rc.model.path and rc.engine_spec("cpu").token_ids is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.eps_low=1.5", "algo.eps_low must be in [0, 1), got 1.5"),
        ("algo.kl=k9", "algo.kl must be one of"),
        ("algo.kl_coef=0.1", "algo.kl_coef must be 0 when kl is 'none'"),
        ("algo.max_refill_rounds=-1", "algo.max_refill_rounds must be an integer >= 0"),
        ("algo.updates_per_step=64", "algo.updates_per_step must be <= rollout.prompts_per_step (32)"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt must be an integer >= 2"),
        ("rollout.temperature=0", "rollout.temperature must be > 0.0"),
        ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1]"),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
        ("rollout.top_k=-5", "rollout.top_k must be an integer >= 0"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens must be an integer >= 1"),
        ("rollout.quantize=int3", "rollout.quantize must be one of"),
        ("rollout.mxfp4_matmul=cutlass", "rollout.mxfp4_matmul must be one of"),
        ("rollout.overlap=yes", "rollout.overlap must be one of"),
        ("rollout.compile_decode=true", "rollout.compile_decode compiles the CUDA-graph decode step"),
        ("rollout.mxfp4_matmul=triton", "rollout.mxfp4_matmul 'triton' needs rollout.quantize"),  # quantize none
        ("rollout.chunk_size=24", "rollout.chunk_size must be a multiple of page_size (16)"),
        ("rollout.page_size=0", "rollout.page_size must be an integer >= 1"),
        ("rollout.max_prefill_requests=0", "rollout.max_prefill_requests must be an integer >= 1"),
        ("rollout.memory_mb=0", "rollout.memory_mb must be > 0.0"),
        ("optim.lr=0", "optim.lr must be > 0.0"),
        ("optim.beta2=1.5", "optim.beta2 must be <= 1.0"),
        ("trainer.max_steps=0", "trainer.max_steps must be an integer >= 1"),
        ("trainer.resume=/no/such/dir", "trainer.resume must be one of"),
        ("parallel.pp=2 parallel.pp_layers=[3]", "parallel.pp_layers must list parallel.pp=2 layer counts"),
        ("parallel.micro_batch_tokens=0", "parallel.micro_batch_tokens must be an integer >= 1"),
        ("parallel.tp=2 parallel.ep=2", "parallel.ep needs parallel.tp=1"),
        ("parallel.ep=2", "parallel.ep must divide dp * cp = 1"),
        ("parallel.sp=true", "parallel.sp needs parallel.tp > 1"),
        (
            "parallel.tp=2",
            "cluster.num_workers must equal the layout's world size tp * pp * cp * dp = 2 * 1 * 1 * 1 = 2",
        ),
        ("parallel.dp=0", "parallel.dp must be an integer >= 1"),
        ("parallel.dp=3", "cluster.num_workers must equal the layout's world size"),
        ("parallel.dp=64 cluster.num_workers=64", "parallel.dp=64 needs at least that many groups per update"),
        ("cluster.device=tpu", "cluster.device must be one of"),
        ("cluster.ray_address=auto", "cluster.ray_address only applies with cluster.launcher=ray"),
        ("reward.on_failure=ignore", "reward.on_failure must be one of"),
        ("reward.url=http://x", "reward.url only applies to fn='remote'"),
        ("reward.fn=remote", "reward.url is required when fn='remote'"),
        ("data.path=prompts.csv", "data.path must end in one of"),
        ("data.prompt_key=label", "data.label_key must differ from prompt_key"),
        ("data.system_prompt=hi", "data.system_prompt: set, but chat_template is None"),
        ("data.eval_path=heldout.txt", "data.path must end in one of"),
        ("data.eval_max_prompts=0", "data.eval_max_prompts must be an integer >= 1"),
        ("model.path=/no/such/model", "model.path must be a directory holding config.json"),
        ("model.preset=k3-small", "model.path or preset must be set, not both"),
        ("model.preset=k3-huge", "model.path or preset must be set"),
        ("lora.rank=0", "lora.rank must be an int >= 1"),
        ("lora.dropout=1.0", "lora.dropout must lie in [0, 1)"),
        ("lora.targets=[]", "lora.targets must name at least one module pattern"),
        ("lora.targets=['q_proj(']", "lora.targets: bad regex"),
        ("logging.wandb=cloud", "logging.wandb must be one of"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError) as e:
        resolve(composed("recipe=k3_grpo", *override.split()))
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_hf_checkpoint_recipe_makes_the_path_mandatory():
    with pytest.raises(ValueError, match=r"^model.path must be set \(it has no default\)"):
        resolve(composed("model=hf_checkpoint"))
    with pytest.raises(ValueError, match="^model.path must be a directory holding config.json"):
        resolve(composed("model=hf_checkpoint", "model.path=/no/such/dir"))


def test_unknown_key_and_wrong_type_fail_at_composition():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        composed("recipe=k3_grpo", "trainer.max_stepz=3")
    assert "max_stepz" in str(e.value)
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        composed("recipe=k3_grpo", "trainer.max_steps=many")
    assert "max_steps" in str(e.value)


def test_resolve_accepts_a_plain_mapping_and_reports_bad_types_in_one_line():
    with pytest.raises(ValueError, match=r"^trainer.max_steps: Value 'x' of type 'str' could not be converted"):
        resolve(OmegaConf.create({"trainer": {"max_steps": "x"}}))
    with pytest.raises(ValueError, match=r"^data.path must be set"):  # no data group: the path is mandatory
        resolve(OmegaConf.create({"model": {"path": "builtin:k3-tiny-arith"}}))


def test_cli_prints_the_whole_config_and_rejects_bad_ones(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "miles_k3.cli.train", "recipe=k3_grpo", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    printed = OmegaConf.create(out.stdout)
    assert printed.recipe == "k3_grpo" and printed.rollout.samples_per_prompt == 8
    # every field of every section is there, the components' defaults included
    schema = OmegaConf.structured(TrainConfig)
    for section in schema:
        if section != "recipe":
            assert set(printed[section]) == set(schema[section]), section
    assert list(printed.lora.targets) == list(DEFAULT_TARGETS) and printed.algo.eps_high == 0.28
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_k3.cli.train",
            "recipe=k3_grpo",
            "algo.eps_high=-1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "miles-train: error: algo.eps_high must be >= 0, got -1.0"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_why_sections_are_mutable_copies_of_the_frozen_components():
    # OmegaConf makes a frozen dataclass's node read-only: no recipe or override could be merged into it
    from omegaconf.errors import ReadonlyConfigError

    @dataclasses.dataclass
    class Holder:
        lora: LoraSpec = dataclasses.field(default_factory=LoraSpec)

    with pytest.raises(ReadonlyConfigError):
        OmegaConf.merge(OmegaConf.structured(Holder), {"lora": {"rank": 4}})
    # the derived section takes the override, and a tuple-typed field a list (the component makes it a tuple)
    node = OmegaConf.merge(OmegaConf.structured(TrainConfig).lora, {"rank": 4, "targets": ["q_proj$"]})
    assert LoraSpec(**OmegaConf.to_object(node).values()) == LoraSpec(rank=4, targets=("q_proj$",))


def test_k3_gb300x64_recipe_resolves_splits_the_real_k3_and_fits_its_gpus_in_both_phases(tmp_path):
    """The 64-GPU recipe: Hydra composes it, every section checks, the published K3 config divides over its
    trainer layout (PP=16 x CP=4, EP=4) and its engine layout (TP=16 with whole experts per rank), and the
    loop's plan of exactly that pair fits a 288 GB GPU while rolling out and while training."""
    import re
    import shutil
    from pathlib import Path

    from megatron_patches.model import check_layout
    from miles_k3.model.config import K3Config
    from miles_k3.model.linear import TensorParallel

    fixture = Path(__file__).parents[1] / "model" / "fixtures" / "kimi_k3_config.json"
    shutil.copy(fixture, tmp_path / "config.json")
    rc = resolve(composed("recipe=k3_gb300x64", f"model.path={tmp_path}"))
    par, r = rc.parallel, rc.rollout
    assert (par.tp, par.pp, par.cp, par.ep, par.world_size, rc.cluster.num_workers) == (1, 16, 4, 4, 64, 64)
    assert (r.tp, r.dcp, r.ep, r.quantize) == (16, 1, True, "all")
    config = K3Config.from_json_file(tmp_path / "config.json")
    check_layout(config, TensorParallel(par.tp), par.ep, par.pp, par.pp_layers)
    rc.engine_spec("cpu").check_layout(config)
    out = subprocess.run(
        [
            sys.executable, "-m", "miles_k3.cli.main", "plan", "--config", str(tmp_path / "config.json"),
            "--gpus", "64", "--gpu-memory-gb", "288", "--seq-len", str(par.micro_batch_tokens), "--recompute",
            "--layout", f"tp={par.tp},pp={par.pp},cp={par.cp},ep={par.ep}", "--engine-layout", f"tp={r.tp},ep=1",
            "--offload", "none",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    best = out.stdout.strip().splitlines()[-1]
    assert f"rollout.tp={r.tp} rollout.dcp=1 rollout.ep=true" in best and f"rollout.memory_mb={r.memory_mb:g}" in best
    rollout, training = map(float, re.search(r"rollout ([\d.]+) GiB, training ([\d.]+) GiB of 288", best).groups())
    assert max(rollout, training) < 288


def test_a_capability_the_rollout_backend_lacks_fails_by_field_before_anything_is_built():
    with pytest.raises(ValueError) as e:
        resolve(composed("rollout.fn=m:f", "rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]"))
    assert str(e.value) == (
        "rollout.fn needs a rollout backend with 'rollout_fn'; rollout.backend='http' runs HTTPEngines, which has "
        "none (backends that do: ['colocated'])"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.backend=http"], "rollout.urls must list the servers' base URLs"),
        (["rollout.backend=http", "rollout.urls=[localhost:30000]"], "rollout.urls must list the servers' base URLs"),
        (["rollout.urls=[http://127.0.0.1:1]"], "rollout.urls only applies with rollout.backend=http"),
        (["rollout.backend=sglang"], "rollout.backend must be one of"),
        (
            ["rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]", "rollout.tp=2"],
            "rollout.tp applies to colocated",
        ),
        (
            ["rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]", "parallel.offload_base=true"],
            "parallel.offload_base parks the trainer's state while colocated engines roll out",
        ),
    ],
)
def test_bad_http_backend_settings_fail_by_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve(composed(*overrides))
