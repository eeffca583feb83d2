"""data.chat_template "hf": prompts rendered by the checkpoint tokenizer's own template (a tokenizer_config.json
with a chat_template, loaded by transformers offline); the built-in "chatml" agrees with a real ChatML
tokenizer's template; bad pairings with model.tokenizer are one error naming data.chat_template."""

import json
import shutil
from pathlib import Path

import pytest

from miles_k3.data import PromptDataConfig, load_prompts, render_prompt
from miles_k3.data.hf_chat import TemplatedPrompts, hf_chat_renderer

ASSET = Path(__file__).resolve().parents[2] / "miles_k3" / "assets" / "k3-tiny-arith"
# ChatML as ChatML tokenizers ship it (each message, then the generation prompt); written here, not fetched
CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
WORDS = ["hi", "be", "brief", "what", "is", "2+2", "4", "ok", "system", "user", "assistant", "S"]


def write_tokenizer(d: Path, template: str | None, bos: bool = False) -> Path:
    """A word-level fast tokenizer (special tokens <s>, <|im_start|>, <|im_end|>) with `template`; with `bos`
    it adds <s> to every encoding, as Llama-style tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    d.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<|im_end|>",
        "bos_token": "<s>",
        "additional_special_tokens": ["<|im_start|>"],
    }
    if template is not None:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def load(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


PROMPTS = [
    ("what is 2+2", None),
    ("what is 2+2", "be brief"),
    ([{"role": "user", "content": "hi"}], None),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "what is 2+2"},
        ],
        "be brief",
    ),
    (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "what is 2+2"},
        ],
        "be brief",
    ),
]


@pytest.mark.parametrize("raw, system", PROMPTS)
def test_builtin_chatml_agrees_with_a_chatml_tokenizers_own_template(tmp_path, raw, system):
    hf = load(write_tokenizer(tmp_path / "tok", CHATML_JINJA))
    render = hf_chat_renderer(hf, "tok")
    assert render_prompt(raw, "chatml", system) == render_prompt(raw, "hf", system, render)


def test_hf_template_renders_the_dataset_and_prompts_encode_without_a_second_bos(tmp_path):
    template = "{{ bos_token }}" + CHATML_JINJA  # the template writes the BOS itself
    hf = load(write_tokenizer(tmp_path / "tok", template, bos=True))
    rows = [
        {"prompt": "what is 2+2", "label": 4},
        {
            "prompt": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "what is 2+2"},
            ],
            "label": 4,
        },
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_prompts(
        PromptDataConfig(path=str(path), chat_template="hf", system_prompt="be brief"), hf_chat_renderer(hf, "tok")
    )
    for rec, row in zip(records, rows):
        msgs = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        want = hf.apply_chat_template(
            [{"role": "system", "content": "be brief"}] + msgs, tokenize=False, add_generation_prompt=True
        )
        assert rec.prompt == want and rec.prompt.startswith("<s><|im_start|>system\nbe brief<|im_end|>")

    from miles_k3.data.tokenizers import HFTokenizer

    ids = TemplatedPrompts(HFTokenizer(str(tmp_path / "tok"))).encode_prompt(records[0].prompt)
    assert ids.count(1) == 1 and ids[0] == 1  # one BOS: the template's
    assert hf.encode(records[0].prompt, add_special_tokens=True).count(1) == 2  # what encode_prompt avoids


def test_hf_template_errors(tmp_path):
    hf = load(write_tokenizer(tmp_path / "plain", None))
    with pytest.raises(ValueError, match=r"^chat_template: 'hf', but the tokenizer in plain has no chat template"):
        hf_chat_renderer(hf, "plain")
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
    render = hf_chat_renderer(load(write_tokenizer(tmp_path / "strict", strict)), "strict")
    with pytest.raises(ValueError, match="chat template rejected the messages: a system message first"):
        render_prompt("hi", "hf", None, render)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "label": 1}\n')
    with pytest.raises(ValueError, match="needs the tokenizer's template"):
        load_prompts(PromptDataConfig(path=str(path), chat_template="hf"))


def test_run_inputs_render_with_the_checkpoints_own_template(tmp_path):
    """Through resolve and load_run_inputs: an HF checkpoint directory (the tiny model's config and weights,
    with the tokenizer above) and data.chat_template=hf."""
    from miles_k3.trainer.inputs import load_run_inputs
    from miles_k3.trainer.resolve import resolve
    from tests.trainer.recipes import composed

    ckpt = tmp_path / "ckpt"
    shutil.copytree(ASSET, ckpt, ignore=shutil.ignore_patterns("*.jsonl", "tokenizer*"))
    write_tokenizer(ckpt, "{{ bos_token }}" + CHATML_JINJA, bos=True)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "what is 2+2"}], "label": 4}) + "\n")
    base = [
        f"model.path={ckpt}",
        "model.tokenizer=hf",
        f"data.path={path}",
        "data.eval_path=null",
        "rollout.prompts_per_step=1",
    ]
    rc = resolve(composed("recipe=k3_grpo", *base, "data.chat_template=hf"))
    inputs = load_run_inputs(rc, tmp_path / "run", weights="skip")
    (rec,) = inputs.train
    assert rec.prompt == "<s><|im_start|>user\nwhat is 2+2<|im_end|>\n<|im_start|>assistant\n"
    assert inputs.tokenizer.encode_prompt(rec.prompt) == [1, 2, 13, 7, 8, 9, 3, 2, 14]  # user what is 2+2 ... assistant

    with pytest.raises(ValueError, match=r"^data.chat_template 'chatml' is the embedded models' built-in"):
        resolve(composed("recipe=k3_grpo", *base, "data.chat_template=chatml"))
    with pytest.raises(ValueError, match=r"^data.chat_template 'hf' .* needs model.tokenizer=hf"):
        resolve(composed("recipe=k3_grpo", "data.chat_template=hf"))
    write_tokenizer(ckpt, None, bos=True)  # no template in the checkpoint
    with pytest.raises(ValueError, match=r"^data.chat_template: 'hf', but the tokenizer in .* has no chat template"):
        load_run_inputs(
            resolve(composed("recipe=k3_grpo", *base, "data.chat_template=hf")), tmp_path / "run", weights="skip"
        )
