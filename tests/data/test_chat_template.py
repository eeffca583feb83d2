"""Chat templates: none, ChatML, format strings; system prompts; message lists."""

import pytest

from miles_k3.data import PromptDataConfig, load_prompts, render_prompt
from miles_k3.data.chat_template import validate_template

IM = "<|im_start|>{role}\n{content}<|im_end|>\n"
GEN = "<|im_start|>assistant\n"


def test_no_template_is_verbatim():
    assert render_prompt("12+3=", None) == "12+3="


def test_chatml_string_with_and_without_system():
    assert render_prompt("hi", "chatml") == IM.format(role="user", content="hi") + GEN
    assert render_prompt("hi", "chatml", "be brief") == (
        IM.format(role="system", content="be brief") + IM.format(role="user", content="hi") + GEN
    )


def test_chatml_messages_and_record_system_message_wins():
    msgs = [
        {"role": "system", "content": "own"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2", "name": "ignored"},
    ]
    want = "".join(IM.format(role=m["role"], content=m["content"]) for m in msgs) + GEN
    assert render_prompt(msgs, "chatml") == want
    assert render_prompt(msgs, "chatml", "default system") == want
    assert render_prompt(msgs[1:], "chatml", "default system").startswith(
        IM.format(role="system", content="default system") + IM.format(role="user", content="q1")
    )


def test_format_string_template():
    assert render_prompt("2+2", "Q: {prompt}\nA:") == "Q: 2+2\nA:"
    assert render_prompt("2+2", "[{system}] {prompt}", "sys") == "[sys] 2+2"
    assert render_prompt("2+2", "[{system}] {prompt}") == "[] 2+2"
    # Literal braces in the template are doubled; braces in the prompt are data, never re-parsed.
    assert render_prompt("{x}", "{{json}} {prompt}") == "{json} {x}"


def test_validate_template_accepts_and_rejects():
    for template, system in [
        (None, None),
        ("chatml", None),
        ("chatml", "s"),
        ("{prompt}", None),
        ("{system}{prompt}", "s"),
    ]:
        validate_template(template, system)
    with pytest.raises(ValueError, match="chat_template: unknown field"):
        validate_template("{prompt} {answer}", None)
    with pytest.raises(ValueError, match="chat_template: must be None"):
        validate_template(3, None)
    with pytest.raises(ValueError, match="system_prompt: must be None or a string"):
        validate_template("chatml", 3)


def test_template_applied_at_load(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "label": 1}\n')
    (r,) = load_prompts(PromptDataConfig(path=str(path), chat_template="chatml", system_prompt="S"))
    assert (
        r.raw_prompt == "hi"
        and r.prompt == IM.format(role="system", content="S") + IM.format(role="user", content="hi") + GEN
    )
