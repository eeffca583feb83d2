"""One engine from one spec (`rollout.build`): the spec checks itself with one line naming the field, the
engine from a spec's base equals the one from the same base handed in (the trainer's way), the adapters load
under their names, and the two front doors (miles-serve, miles-k3 generate) build their engine flags from the
same definition (`rollout.server.config.EngineFlags`)."""

from __future__ import annotations

import argparse

import pytest
import torch

from miles_k3.data.tokenizers import preset_token_ids
from miles_k3.model.assets import ASSETS_DIR, builtin_path
from miles_k3.model.base import load_base, load_base_config
from miles_k3.model.lora_spec import LoraSpec
from rollout.build import EngineSpec, build_engine
from rollout.config import EngineConfig
from rollout.request import SamplingParams

MODEL = "builtin:k3-tiny-arith"
CONFIG = EngineConfig(memory_bytes=8 << 20, max_seq_len=64)
PROMPTS = [[1, 5, 7, 4], [1, 9, 9]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def spec(**fields) -> EngineSpec:
    return EngineSpec(**{"path": MODEL, "quantize": "none", "engine": CONFIG, **fields})


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(path="/no/such/dir"), "EngineSpec.path must be a directory holding config.json"),
        (dict(preset="k3-tiny"), "EngineSpec.path or EngineSpec.preset, not both"),
        (dict(path=None, preset="k3-nope"), "EngineSpec.preset must be one of"),
        (dict(vocab_size=32), "EngineSpec.vocab_size only applies with EngineSpec.preset"),
        (dict(quantize="int4"), "EngineSpec.quantize must be one of"),
        (dict(dtype="float16"), "EngineSpec.dtype must be one of"),
        (dict(device="tpu"), "EngineSpec.device must be a cpu or cuda device"),
        (dict(lora={"rank": 4}), "EngineSpec.lora must be a LoraSpec"),
        (dict(adapters=(("a", "x"), ("a", "y"))), "EngineSpec.adapters names must be distinct"),
        (dict(adapters=(("a=b", "x"),)), "EngineSpec.adapters must be (name, PEFT directory) pairs"),
        (dict(adapters=(("a", "x"), ("b", "y")), max_adapters=1), "EngineSpec.max_adapters must be an integer >= 2"),
        (dict(tp=0), "EngineSpec.tp must be an integer >= 1"),
        (dict(tp=2, ep=3), "EngineSpec.ep must be 1 or EngineSpec.tp (2)"),
        (dict(tp=4, dcp=3), "EngineSpec.dcp must divide EngineSpec.tp (4)"),
        (dict(tp=2, dcp=2, engine=EngineConfig(memory_bytes=1 << 20, dcp_size=4)), "EngineSpec.engine.dcp_size=4"),
        (dict(engine={"memory_bytes": 1}), "EngineSpec.engine must be an EngineConfig"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_field(fields, needle):
    with pytest.raises(ValueError) as e:
        spec(**fields)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_spec_normalizes_what_it_is_given():
    s = spec()
    assert s.path == builtin_path(MODEL) and s.dtype == "float32" and s.device == "cpu" and s.max_adapters == 1
    s = spec(dtype=torch.bfloat16, device="cuda:1", tp=2, dcp=2)
    assert s.dtype == "bfloat16" and s.device == "cuda:1" and s.engine.dcp_size == 2
    assert spec(device="cuda").dtype == "bfloat16"  # as the server's --dtype default
    assert spec(adapters=[("a", ASSETS_DIR), ("b", ASSETS_DIR)]).adapters == (
        ("a", str(ASSETS_DIR)),
        ("b", str(ASSETS_DIR)),
    )
    assert spec(path=None).has_base is False
    with pytest.raises(ValueError, match="EngineSpec names no base"):
        build_engine(spec(path=None))


def test_a_preset_base_takes_the_tokenizers_special_ids():
    config = load_base_config(preset="k3-tiny", vocab_size=32, token_ids=preset_token_ids("arithmetic"))
    assert (config.vocab_size, config.eos_token_id) == (32, preset_token_ids("arithmetic")["eos_token_id"])
    s = EngineSpec(preset="k3-tiny", vocab_size=32, token_ids=preset_token_ids("arithmetic"), seed=3, engine=CONFIG)
    assert s.base_config() == config
    for kwargs, needle in (
        (dict(), "exactly one"),
        (dict(path="x", preset="k3-tiny"), "exactly one"),
        (dict(path=builtin_path(MODEL), vocab_size=32), "apply to a preset only"),
        (dict(preset="k3-tiny", token_ids={"unk_token_id": 0}), "token_ids may set"),
    ):
        with pytest.raises(ValueError, match=needle):
            load_base_config(**kwargs)


def test_an_engine_from_a_base_in_memory_equals_one_from_the_spec():
    """The trainer's call (its loaded base handed in, no path in the spec) and the server's (the spec's path)."""
    from_spec = build_engine(spec()).generate(PROMPTS, GREEDY)
    config, state = load_base(builtin_path(MODEL))
    handed = build_engine(EngineSpec(quantize="none", engine=CONFIG), base=(config, state)).generate(PROMPTS, GREEDY)
    assert [c.output_ids for c in handed] == [c.output_ids for c in from_spec]
    assert [c.logprobs for c in handed] == [c.logprobs for c in from_spec]
    other = load_base_config(preset="k3-tiny", vocab_size=64)
    with pytest.raises(ValueError, match="not the spec's"):
        build_engine(spec(), base=(other, state))


def test_adapters_load_under_their_names_and_must_share_one_shape(tmp_path):
    from tests.server.common import write_adapter

    adapter = str(write_adapter(tmp_path / "a", seed=1))
    engine = build_engine(spec(adapters=(("policy", adapter),)))
    assert set(engine.adapters.names) == {"policy"}
    base = engine.generate(PROMPTS, GREEDY)
    tuned = engine.generate(PROMPTS, GREEDY, adapter="policy")
    assert [c.logprobs for c in base] != [c.logprobs for c in tuned]
    with pytest.raises(ValueError, match=r"EngineSpec.adapters policy=.*differs from EngineSpec.lora's"):
        build_engine(spec(adapters=(("policy", adapter),), lora=LoraSpec(rank=8)))
    with pytest.raises(ValueError, match=f"EngineSpec.adapters bad={tmp_path}"):
        build_engine(spec(adapters=(("bad", str(tmp_path)),)))


def test_build_errors_are_renamed_to_the_flags():
    from rollout.server.config import flag_errors

    for raised, shown in (
        ("EngineSpec.adapters x=/d: no adapter", "--adapter x=/d: no adapter"),
        ("EngineSpec.quantize must be one of", "--quantize must be one of"),
        ("EngineSpec.path must be a directory", "--model must be a directory"),
        ("something else", "something else"),
    ):
        with pytest.raises(ValueError) as e, flag_errors():
            raise ValueError(raised)
        assert str(e.value) == shown


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def test_serve_and_generate_define_their_engine_flags_once():
    from miles_k3.cli.generate import add_arguments
    from rollout.server.__main__ import build_parser
    from rollout.server.config import ENGINE_FLAGS

    serve = _options(build_parser())
    generate_parser = argparse.ArgumentParser()
    add_arguments(generate_parser)
    generate = _options(generate_parser)
    for name in ENGINE_FLAGS:
        s, g = serve[name], generate[name]
        assert (s.option_strings, s.help, s.type, s.required) == (g.option_strings, g.help, g.type, g.required), name
        if name != "memory_mb":  # a batch holds all its rows' KV at once: generate's default is larger
            assert s.default == g.default, name
    assert (serve["memory_mb"].default, generate["memory_mb"].default) == (64.0, 256.0)
