"""PromptDataConfig validation and load_prompts: jsonl and parquet, keys, metadata, every error path."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_k3.data import PromptDataConfig, PromptRecord, load_prompts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


ROWS = [
    {"prompt": "1+1=", "label": 2, "src": "a", "difficulty": 1},
    {"prompt": "2+3=", "label": 5, "src": "b", "difficulty": 2},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_load_with_defaults_keeps_other_keys_as_metadata(tmp_path, fmt):
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", ROWS)
    recs = load_prompts(PromptDataConfig(path=str(path)))
    assert recs == [
        PromptRecord(index=0, prompt="1+1=", raw_prompt="1+1=", label=2, metadata={"src": "a", "difficulty": 1}),
        PromptRecord(index=1, prompt="2+3=", raw_prompt="2+3=", label=5, metadata={"src": "b", "difficulty": 2}),
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_custom_keys_and_selected_metadata(tmp_path, fmt):
    rows = [
        {"question": "q0", "answer": "x", "id": 7, "junk": [1]},
        {"question": "q1", "answer": "y", "id": 8, "junk": [2]},
    ]
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", rows)
    c = PromptDataConfig(path=path, prompt_key="question", label_key="answer", metadata_keys=["id"])
    assert c.metadata_keys == ("id",) and isinstance(c.path, str)
    recs = load_prompts(c)
    assert [(r.prompt, r.label, r.metadata) for r in recs] == [("q0", "x", {"id": 7}), ("q1", "y", {"id": 8})]


def test_unlabeled_data_and_empty_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "extra": 1}])
    (r,) = load_prompts(PromptDataConfig(path=str(path), label_key=None, metadata_keys=()))
    assert r.label is None and r.metadata == {}


def test_blank_lines_skipped_and_index_counts_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a", "label": 1}\n   \n{"prompt": "b", "label": 2}\n\n')
    assert [(r.index, r.prompt) for r in load_prompts(PromptDataConfig(path=str(path)))] == [(0, "a"), (1, "b")]


def test_parquet_message_lists(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    (r,) = load_prompts(PromptDataConfig(path=str(path), chat_template="chatml"))
    assert r.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- config validation: ValueError names the field ---


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"path": "d.csv"}, "path"),
        ({"path": "d"}, "path"),
        ({"path": ""}, "path"),
        ({"prompt_key": ""}, "prompt_key"),
        ({"label_key": ""}, "label_key"),
        ({"label_key": "prompt"}, "label_key"),
        ({"metadata_keys": "src"}, "metadata_keys"),
        ({"metadata_keys": ("a", "a")}, "metadata_keys"),
        ({"metadata_keys": ("prompt",)}, "metadata_keys"),
        ({"metadata_keys": (1,)}, "metadata_keys"),
        ({"chat_template": "llama3"}, "chat_template"),
        ({"chat_template": "Q: {question}"}, "chat_template"),
        ({"chat_template": "Q: {prompt"}, "chat_template"),
        ({"chat_template": "{prompt!r}"}, "chat_template"),
        ({"system_prompt": "be brief"}, "system_prompt"),
        ({"chat_template": "Q: {prompt}", "system_prompt": "be brief"}, "system_prompt"),
        ({"shuffle": "yes"}, "shuffle"),
        ({"drop_last": 1}, "drop_last"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    kwargs = {"path": "d.jsonl", **kwargs}
    with pytest.raises(ValueError, match=rf"^PromptDataConfig\.{field}\b"):
        PromptDataConfig(**kwargs)


def test_config_is_frozen_and_format_from_suffix():
    c = PromptDataConfig(path="x/D.PARQUET")
    assert c.format == "parquet" and PromptDataConfig(path="d.jsonl").format == "jsonl"
    with pytest.raises(AttributeError):
        c.seed = 3


# --- load errors: file, line/row and key ---


def load_jsonl_text(tmp_path, text, **kw):
    path = tmp_path / "d.jsonl"
    path.write_text(text, encoding="utf-8")
    return load_prompts(PromptDataConfig(path=str(path), **kw))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(PromptDataConfig(path=str(tmp_path / "nope.jsonl")))


@pytest.mark.parametrize(
    "text, kw, pattern",
    [
        ('{"prompt": "a", "label": 1}\n{"prompt": "b", "label": }\n', {}, r"d\.jsonl line 2: malformed JSON"),
        ('{"prompt": "a", "label": 1}\n\n[1, 2]\n', {}, r"line 3: expected a JSON object, got list"),
        ('{"prompt": "a", "label": 1}\n{"text": "b", "label": 2}\n', {}, r"line 2: missing prompt key 'prompt'"),
        ('{"prompt": 5, "label": 1}\n', {}, r"line 1: key 'prompt': must be a string or a list .* got int"),
        ('{"prompt": null, "label": 1}\n', {}, r"line 1: key 'prompt': .* got NoneType"),
        ('{"prompt": "", "label": 1}\n', {}, r"line 1: key 'prompt': empty string"),
        ('{"q": "a"}\n', {"prompt_key": "q"}, r"line 1: missing label key 'label'"),
        ('{"prompt": "a", "label": null}\n', {}, r"line 1: label key 'label' is null"),
        ('{"prompt": "a", "label": 1}\n', {"metadata_keys": ("id",)}, r"line 1: missing metadata key 'id'"),
        (
            '{"prompt": [{"role": "user", "content": "hi"}], "label": 1}\n',
            {},
            r"line 1: key 'prompt': a chat-message list needs chat_template='chatml'",
        ),
        (
            '{"prompt": [{"role": "user", "content": "hi"}], "label": 1}\n',
            {"chat_template": "Q: {prompt}"},
            r"line 1: key 'prompt': a chat-message list needs",
        ),
        (
            '{"prompt": [], "label": 1}\n',
            {"chat_template": "chatml"},
            r"line 1: key 'prompt': messages must be a non-empty list",
        ),
        (
            '{"prompt": [{"role": "bot", "content": "hi"}], "label": 1}\n',
            {"chat_template": "chatml"},
            r"line 1: key 'prompt': messages\[0\]\.role must be one of .*got 'bot'",
        ),
        (
            '{"prompt": [{"role": "user", "content": 3}], "label": 1}\n',
            {"chat_template": "chatml"},
            r"line 1: key 'prompt': messages\[0\]\.content must be a string",
        ),
        (
            '{"prompt": ["hi"], "label": 1}\n',
            {"chat_template": "chatml"},
            r"line 1: key 'prompt': messages\[0\] must be",
        ),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "label": 1}\n',
            {"chat_template": "chatml"},
            r"line 1: key 'prompt': the last message must have role 'user'",
        ),
        ("\n\n", {}, r"d\.jsonl: empty dataset"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path, text, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_jsonl_text(tmp_path, text, **kw)


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": 1}\n{"prompt": "\xff", "label": 1}\n')
    with pytest.raises(ValueError, match=r"line 2: not valid UTF-8"):
        load_prompts(PromptDataConfig(path=str(path)))


def test_leading_bom_tolerated(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": 1}\n')
    assert load_prompts(PromptDataConfig(path=str(path)))[0].prompt == "a"


def test_parquet_errors_name_file_row_and_key(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a", "label": 1}, {"prompt": None, "label": 2}])
    with pytest.raises(ValueError, match=r"d\.parquet row 1 \(0-based\): key 'prompt'.*NoneType"):
        load_prompts(PromptDataConfig(path=str(path)))
    with pytest.raises(ValueError, match=r"d\.parquet row 0 \(0-based\): missing prompt key 'question'"):
        load_prompts(PromptDataConfig(path=str(path), prompt_key="question"))
    with pytest.raises(ValueError, match=r"d\.parquet row 0 \(0-based\): missing label key 'answer'"):
        load_prompts(PromptDataConfig(path=str(path), label_key="answer"))


def test_parquet_empty_and_corrupt(tmp_path):
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.int64())}), empty)
    with pytest.raises(ValueError, match=r"e\.parquet: empty dataset"):
        load_prompts(PromptDataConfig(path=str(empty)))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
        load_prompts(PromptDataConfig(path=str(bad)))
