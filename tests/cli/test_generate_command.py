"""`miles-k3 generate`: the engine's batch front door. Greedy output equals the reference model's, a row's
sample does not depend on the rows beside it, an adapter changes the outputs as the engine's does, and bad
input stops it in one line naming the flag or the row (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_k3.cli.main import main
from miles_k3.model.assets import builtin_path
from miles_k3.model.base import load_base
from miles_k3.model.generate import greedy_generate

MODEL = "builtin:k3-tiny-arith"
ROWS = [[1, 5, 7], [1, 5, 9, 11, 4], [2, 3]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(tmp_path: Path, *flags: str, rows=ROWS, name: str = "out.json") -> list[dict]:
    ids = write_jsonl(tmp_path / f"{name}.jsonl", [{"input_ids": r} for r in rows])
    out = tmp_path / name
    assert main(["generate", "--model", MODEL, "--input-ids", str(ids), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())["outputs"]


def test_greedy_outputs_equal_the_reference_model(tmp_path):
    outputs = generate(tmp_path, "--temperature", "0", "--max-new-tokens", "6", "--quantize", "none")
    config, state = load_base(builtin_path(MODEL))
    from miles_k3.model.modeling import K3ForCausalLM

    ref = K3ForCausalLM(config).eval()
    ref.load_state_dict(state)
    assert len(outputs) == len(ROWS)
    for row, out in zip(ROWS, outputs):
        tokens, logps = greedy_generate(ref, torch.tensor([row]), 6)
        assert out["output_ids"] == tokens[0].tolist() and out["finish_reason"] == "length"
        torch.testing.assert_close(torch.tensor(out["logprobs"]), logps[0], atol=1e-4, rtol=0)


def test_a_rows_sample_does_not_depend_on_the_rows_after_it(tmp_path):
    flags = ("--temperature", "1", "--top-k", "8", "--max-new-tokens", "5", "--seed", "3")
    two = generate(tmp_path, *flags, rows=ROWS[:2], name="two.json")
    three = generate(tmp_path, *flags, rows=ROWS, name="three.json")
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in three[:2]]
    for a, b in zip(two, three):  # a batch of other rows changes only the float summation order
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5, rtol=0)
    other_seed = generate(tmp_path, *flags[:-1], "4", rows=ROWS[:2], name="seed4.json")
    assert [o["output_ids"] for o in other_seed] != [o["output_ids"] for o in two]


def test_prompts_and_messages_are_encoded_and_stop_at_eos(tmp_path):
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "12+7="}, {"messages": [{"role": "user", "content": "3*4="}]}]
    )
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "generate",
                "--model",
                MODEL,
                "--prompts",
                str(prompts),
                "--json",
                str(out),
                "--temperature",
                "0",
                "--max-new-tokens",
                "40",
            ]
        )
        == 0
    )
    outputs = json.loads(out.read_text())["outputs"]
    assert [o["finish_reason"] for o in outputs] == ["stop", "stop"]
    assert all(isinstance(o["text"], str) and len(o["logprobs"]) == len(o["output_ids"]) for o in outputs)


def test_an_adapter_changes_the_outputs(tmp_path):
    from tests.server.common import write_adapter

    adapter = write_adapter(tmp_path / "adapter", seed=1)
    base = generate(tmp_path, "--temperature", "0", "--max-new-tokens", "6", name="base.json")
    tuned = generate(
        tmp_path, "--temperature", "0", "--max-new-tokens", "6", "--adapter", str(adapter), name="tuned.json"
    )
    assert [o["logprobs"] for o in base] != [o["logprobs"] for o in tuned]


@pytest.mark.parametrize(
    "lines, flags, needle",
    [
        (['{"input_ids": [1, 2]}', "not json"], (), "line 2: malformed JSON"),
        (['{"ids": [1, 2]}'], (), "line 1: input_ids must be a non-empty list of integers"),
        (['{"input_ids": []}'], (), "line 1: input_ids must be a non-empty list"),
        (['{"input_ids": [1, 100000]}'], (), "row 1: token id 100000 is outside the model's vocabulary"),
        (["[1, 2]"], (), "line 1: expected a JSON object"),
        ([], (), "no rows"),
        (['{"input_ids": [1]}'], ("--dcp", "2"), "--dcp 2 must divide --tp 1"),
        (['{"input_ids": [1]}'], ("--ep",), "--ep needs --tp > 1"),
        (['{"input_ids": [1]}'], ("--speculative", "dspark"), "--speculative dspark and --drafter go together"),
        (['{"input_ids": [1]}'], ("--speculative", "dspark", "--drafter", "/nonexistent"), "--drafter /nonexistent"),
        (['{"input_ids": [1]}'], ("--max-new-tokens", "0"), "SamplingParams.max_new_tokens"),
        (['{"input_ids": [1, 2, 3]}'], ("--max-seq-len", "4", "--max-new-tokens", "2"), "exceed the engine's max"),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, lines, flags, needle):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out.json"
    assert main(["generate", "--model", MODEL, "--input-ids", str(ids), "--json", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_a_missing_model_or_file_is_named(tmp_path, capsys):
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1]}])
    assert main(["generate", "--model", "builtin:nope", "--input-ids", str(ids)]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["generate", "--model", MODEL, "--input-ids", str(tmp_path / "missing.jsonl")]) == 2
    assert "--input-ids" in capsys.readouterr().err


SAMPLINGS = {"greedy": ("--temperature", "0"), "seeded": ("--temperature", "1", "--seed", "5")}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("one_rank")
    return {k: generate(tmp, *flags, "--max-new-tokens", "6", name=f"{k}.json") for k, flags in SAMPLINGS.items()}


@pytest.mark.parametrize("flags", [("--tp", "2", "--dcp", "2"), ("--tp", "2", "--ep")], ids=["tp2-dcp2", "tp2-ep"])
def test_tensor_parallel_workers_equal_one_rank(tmp_path, flags, one_rank):
    """Two gloo worker processes give one process's tokens and log-probs, greedy and seeded sampling (the
    engine's own tests cover plain TP=2, tests/rollout/test_engine_parallel.py)."""
    for kind, sampling in SAMPLINGS.items():
        many = generate(tmp_path, *sampling, "--max-new-tokens", "6", *flags, name=f"{kind}.json")
        assert [o["output_ids"] for o in many] == [o["output_ids"] for o in one_rank[kind]]
        for a, b in zip(one_rank[kind], many):
            torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-4, rtol=0)


def test_speculative_decoding_is_lossless_through_the_command(tmp_path):
    """A DSpark drafter (random: it drafts badly, so verification rejects and replays often) changes neither the
    greedy tokens nor their log-probs."""
    from rollout.spec.drafter import DSparkConfig, DSparkDrafter

    config, _ = load_base(builtin_path(MODEL))
    torch.manual_seed(0)
    DSparkDrafter(
        DSparkConfig(
            target_layers=(0, config.num_hidden_layers - 1),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            block_size=3,
            context_window=16,
        )
    ).save(tmp_path / "dr")
    flags = ("--temperature", "0", "--max-new-tokens", "8")
    plain = generate(tmp_path, *flags, name="plain.json")
    speculative = ("--speculative", "dspark", "--drafter", str(tmp_path / "dr"), "--gamma", "3")
    spec = generate(tmp_path, *flags, *speculative, name="spec.json")
    sharded = generate(tmp_path, *flags, *speculative, "--tp", "2", name="spec_tp2.json")  # two gloo ranks
    for run in (spec, sharded):
        assert [o["output_ids"] for o in run] == [o["output_ids"] for o in plain]
        for a, b in zip(plain, run):
            torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-4, rtol=0)
