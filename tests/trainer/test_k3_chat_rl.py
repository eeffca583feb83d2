"""data.chat_template=k3 through the GRPO loop, on a random-init k3-tiny with a tiny K3 tokenizer
(`tests/data/k3_chat_checkpoint.py`): prompts are K3's rendering as ids (the row's tools in it, the think
channel opened or not), generation stops at the checkpoint's end-of-turn token, the reward reads the response
channel and the reasoning apart, a multi-turn plugin gets each turn's parsed reply and K3's continuation, and
bad pairings fail in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_k3.data.k3_chat import RenderedChat
from miles_k3.trainer.resolve import resolve
from tests.data.k3_chat_checkpoint import END_OF_MSG, write_k3_chat_checkpoint
from tests.data.test_k3_chat import TOOLS
from tests.trainer.recipes import composed
from tests.trainer.test_media_rl import build

SEEN: list = []  # what the reward saw: (prompt ids, output ids, response, reasoning)
TURNS: list = []  # what the rollout function saw of each turn


def reward(sample) -> float:
    SEEN.append((list(sample.prompt_ids), list(sample.output_ids), sample.response, sample.reasoning))
    return float(len(sample.response + (sample.reasoning or "")) % 2)


async def two_turns(client, record):
    """A policy turn, a tool's result in K3's continuation, a second turn."""
    sample = client.sample
    turn = await client.generate(sample.ids, max_new_tokens=3)
    TURNS.append((client.chat.reply(turn.prompt_ids, turn.output_ids), turn.response, turn.reasoning))
    sample.add_policy(turn)
    sample.add_environment(client.chat.continuation([{"role": "tool", "name": "get_weather", "content": "20C"}]))
    sample.add_policy(await client.generate(sample.ids, max_new_tokens=3))
    return sample


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3rl")
    write_k3_chat_checkpoint(root / "ckpt")
    rows = [
        {"prompt": "What is 2+2?", "label": 4},
        {"prompt": [{"role": "user", "content": "Weather in Paris?"}], "label": 0, "tools": TOOLS},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def overrides(root: Path, *extra: str) -> list[str]:
    return [
        "recipe=k3_grpo",
        f"model.path={root / 'ckpt'}",
        "model.tokenizer=hf",
        f"data.path={root / 'train.jsonl'}",
        "data.eval_path=null",
        "data.shuffle=false",
        "data.chat_template=k3",
        "data.tools_key=tools",
        f"reward.fn={__name__}:reward",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8",
        "rollout.record_routing=false",
        "algo.routing_replay=off",
        "algo.dynamic_sampling=false",
        "trainer.max_steps=1",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        "trainer.eval_before=false",
        "logging.progress=false",
        "logging.wandb=disabled",
        *extra,
    ]


@pytest.mark.parametrize("thinking", [True, False])
def test_k3_prompts_stop_at_the_end_of_turn_and_the_reward_reads_the_channels_apart(k3, tmp_path, thinking):
    from miles_k3.trainer.loop import GRPODriver

    rc = resolve(composed(*overrides(k3, f"data.thinking={str(thinking).lower()}")))
    inputs, _, _, workers = build(rc, tmp_path)
    workers[0].sync_adapter(workers[1])
    chat = inputs.tokenizer.chat
    assert inputs.tokenizer.eos_token_id == END_OF_MSG
    a, b = inputs.train
    assert isinstance(b.prompt, RenderedChat) and "tool-declare" in b.prompt
    assert list(b.prompt.ids) == chat.render(b.raw_prompt, TOOLS, thinking=thinking)
    assert list(a.prompt.ids) == chat.render([{"role": "user", "content": "What is 2+2?"}], thinking=thinking)
    driver = GRPODriver(rc, tmp_path, *workers, inputs)
    assert driver._params(seed=0).stop_token_ids == (END_OF_MSG,)  # not the tokenizer's generic [EOS]
    SEEN.clear()
    driver.collect(1)
    assert len(SEEN) == 4
    for prompt, output, response, reasoning in SEEN:
        assert prompt in (list(a.prompt.ids), list(b.prompt.ids))
        assert END_OF_MSG not in output[:-1]  # the engine stopped at the end of the turn
        turn = chat.reply(prompt, output)
        assert (response, reasoning) == (turn.content, turn.reasoning)
        assert (reasoning is not None) == thinking


def test_a_multi_turn_plugin_gets_each_turns_parsed_reply(k3, tmp_path):
    from miles_k3.trainer.loop import GRPODriver

    rc = resolve(composed(*overrides(k3, f"rollout.fn={__name__}:two_turns")))
    inputs, _, _, workers = build(rc, tmp_path)
    workers[0].sync_adapter(workers[1])
    driver = GRPODriver(rc, tmp_path, *workers, inputs)
    TURNS.clear()
    SEEN.clear()
    batch, _ = driver.collect(1)
    assert len(TURNS) == 4
    for parsed, response, reasoning in TURNS:
        assert (response, reasoning) == (parsed.content, parsed.reasoning) and reasoning is not None
    chat = inputs.tokenizer.chat
    env = chat.continuation([{"role": "tool", "name": "get_weather", "content": "20C"}])
    for prompt, output, response, reasoning in SEEN:  # the reward reads the sample's last reply: the second turn
        end = next(k + len(env) for k in range(len(output)) if output[k : k + len(env)] == env)
        second = chat.reply(prompt + output[:end], output[end:])
        assert (response, reasoning) == (second.content, second.reasoning) and reasoning is not None


def test_k3_pairings_fail_in_one_line_naming_the_field(k3, tmp_path):
    from miles_k3.trainer.inputs import load_run_inputs
    from tests.vl_checkpoint import write_vl_checkpoint

    with pytest.raises(ValueError, match="data.chat_template 'k3' .* needs model.tokenizer=hf"):
        resolve(composed("recipe=k3_grpo", "data.chat_template=k3"))
    with pytest.raises(ValueError, match="data.tools_key needs chat_template='k3'"):
        resolve(composed(*overrides(k3, "data.chat_template=hf")))
    vl = write_vl_checkpoint(tmp_path / "vl")
    rc = resolve(composed(*overrides(k3, f"model.path={vl}")))
    with pytest.raises(ValueError, match=r"data.chat_template 'k3': the tokenizer in .* has no K3 structure token"):
        load_run_inputs(rc, tmp_path, weights="skip")
