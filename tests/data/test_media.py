"""XTML media prompts: placeholder expansion against hand-written strings, pad positions from token ids,
data URLs, image references, chat content parts, and every mismatch error."""

import base64
from types import SimpleNamespace

import pytest
import torch

from miles_k3.data import render_prompt
from miles_k3.data.chat_template import validate_messages
from miles_k3.data.media import (
    IMAGE_PLACEHOLDER,
    ImageRef,
    decode_data_url,
    encode_data_url,
    expand_media_prompt,
    image_block,
    image_ref,
    media_pad_positions,
    message_images,
)

PH = "<|kimi_image_placeholder|>"
PAD = "<|media_pad|>"


def img(w, h, n):
    return SimpleNamespace(size=(w, h), num_tokens=n)


# --- expansion ---


def test_one_image_expands_to_the_published_block():
    # header with the ORIGINAL size, one space after "image", media_content straight after it, N pads, end.
    want = "Q: <|media_begin|>image 225x223<|media_content|>" + PAD * 3 + "<|media_end|> how many?"
    assert expand_media_prompt(f"Q: {PH} how many?", [img(225, 223, 3)]) == want
    assert image_block(img(56, 84, 1)) == "<|media_begin|>image 56x84<|media_content|><|media_pad|><|media_end|>"


def test_images_expand_in_order_and_text_without_images_is_unchanged():
    got = expand_media_prompt(f"{PH}a{PH}", [img(1, 2, 1), img(3, 4, 2)])
    assert got == (
        "<|media_begin|>image 1x2<|media_content|><|media_pad|><|media_end|>a"
        "<|media_begin|>image 3x4<|media_content|><|media_pad|><|media_pad|><|media_end|>"
    )
    assert expand_media_prompt("just text", []) == "just text"


@pytest.mark.parametrize(
    "text, n, match",
    [
        (f"{PH}{PH}", 1, r"prompt has 2 image placeholder\(s\) .* but 1 image\(s\) were given"),
        ("no placeholder", 1, r"prompt has 0 image placeholder\(s\) .* but 1 image\(s\) were given"),
        (PH, 0, r"prompt has 1 image placeholder\(s\) .* but 0 image\(s\) were given"),
    ],
)
def test_a_placeholder_count_mismatch_names_both_counts(text, n, match):
    with pytest.raises(ValueError, match=match):
        expand_media_prompt(text, [img(1, 1, 1)] * n)


# --- pad positions ---


def test_pad_positions_per_image():
    P = 3
    ids = [1, 9, P, P, 8, 9, P, P, P, 8, 5]
    runs = media_pad_positions(ids, [img(1, 1, 2), img(1, 1, 3)], P)
    assert runs == [range(2, 4), range(6, 9)]
    assert media_pad_positions(torch.tensor([P, P]), [img(1, 1, 2)], P) == [range(0, 2)]  # a run at the end
    assert media_pad_positions([1, 2], [], P) == []


@pytest.mark.parametrize(
    "ids, images, match",
    [
        ([1, 3, 3, 2], [img(1, 1, 2), img(1, 1, 1)], r"1 media pad run\(s\) \(id 3\) but 2 image\(s\)"),
        ([1, 2], [img(1, 1, 1)], r"0 media pad run\(s\) \(id 3\) but 1 image\(s\)"),
        ([1, 3, 3, 2], [img(1, 1, 3)], r"image 0: its media pad run at position 1 has 2 token\(s\), the image takes 3"),
        ([3, 2, 3, 3], [img(1, 1, 1), img(1, 1, 1)], r"image 1: its media pad run at position 2 has 2 token\(s\)"),
    ],
)
def test_pad_position_mismatches_fail(ids, images, match):
    with pytest.raises(ValueError, match=match):
        media_pad_positions(ids, images, 3)


# --- data URLs ---


def test_data_urls_round_trip():
    data = bytes(range(256)) * 3
    url = encode_data_url(data, "image/jpeg")
    assert url.startswith("data:image/jpeg;base64,") and decode_data_url(url) == data
    # parameters before base64 are allowed
    assert decode_data_url("data:image/png;charset=x;base64," + base64.b64encode(b"ab").decode()) == b"ab"


@pytest.mark.parametrize(
    "url, match",
    [
        ("https://example.com/cat.png", r"^image_url: only data URLs .* got 'https://example.com/cat.png'"),
        ("data:image/png;base64", r"malformed data URL"),
        ("data:text/plain;base64,aGk=", r"media type 'text/plain'; expected image/\*"),
        ("data:,aGk=", r"media type 'text/plain'"),
        ("data:image/png,rawbytes", r"not base64"),
        ("data:image/png;base64,@@@", r"invalid base64"),
        (3, r"must be a data URL string, got int"),
    ],
)
def test_bad_data_urls_fail_in_one_line(url, match):
    with pytest.raises(ValueError, match=match) as e:
        decode_data_url(url)
    assert "\n" not in str(e.value)


# --- image references ---


def test_image_refs_resolve_paths_against_the_base_and_keep_data_lazy(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(b"x")
    ref = image_ref("imgs/a.png", base_dir=tmp_path, where="f line 1")
    assert ref.source == str((tmp_path / "imgs" / "a.png").resolve()) and ref.load() == ref.source
    url = encode_data_url(b"pixels")
    lazy = image_ref(url, base_dir=None, where="f line 2")
    assert lazy.source == url and lazy.load() == b"pixels" and lazy.name == f"f line 2: data URL ({len(url)} chars)"
    assert image_ref(b"raw", base_dir=None, where="w").load() == b"raw"
    assert ImageRef(b"raw").fingerprint() != ImageRef(b"raw2").fingerprint()
    with pytest.raises(ValueError, match=r"f line 3: image file 'imgs/b.png' not found"):
        image_ref("imgs/b.png", base_dir=tmp_path, where="f line 3")
    with pytest.raises(ValueError, match=r"w: image paths are not accepted here; send the image as a data URL"):
        image_ref("imgs/a.png", base_dir=None, where="w")
    with pytest.raises(ValueError, match=r"w: an image must be a path, a data URL or bytes, got 5"):
        image_ref(5, base_dir=None, where="w")


# --- chat content parts ---

URL = encode_data_url(b"\x89PNG fake")
MESSAGES = [
    {"role": "system", "content": "count things"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "How many? "},
            {"type": "image_url", "image_url": {"url": URL}},
            {"type": "text", "text": " and "},
            {"type": "image", "image": "b.png"},
        ],
    },
]


def test_content_parts_render_as_placeholders_in_order_through_the_templates(tmp_path):
    (tmp_path / "b.png").write_bytes(b"x")
    user = f"How many? {PH} and {PH}"
    assert validate_messages(MESSAGES)[1] == {"role": "user", "content": user}
    assert render_prompt(MESSAGES, "chatml") == (
        f"<|im_start|>system\ncount things<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    seen = []
    render_prompt(MESSAGES, "hf", apply_chat=lambda m: seen.append(m) or "x")
    assert seen[0][1]["content"] == user  # the tokenizer's template gets plain text too
    refs = message_images(MESSAGES, base_dir=tmp_path, where="data.jsonl line 1")
    assert [r.source for r in refs] == [URL, str((tmp_path / "b.png").resolve())]
    assert refs[0].where == "data.jsonl line 1: message 1 part 1"
    assert refs[0].load() == b"\x89PNG fake"
    # the placeholders and the images line up
    assert render_prompt(MESSAGES, "chatml").count(IMAGE_PLACEHOLDER) == len(refs)


@pytest.mark.parametrize(
    "part, match",
    [
        (
            {"type": "audio", "audio": "x"},
            r"messages\[0\]\.content\[1\]: expected an object with type 'text', 'image_url' or 'image'",
        ),
        ({"type": "text"}, r"messages\[0\]\.content\[1\]: a text part needs a string 'text'"),
        ({"type": "image_url", "image_url": {}}, r"type 'image_url' needs 'image_url'"),
        ({"type": "image"}, r"type 'image' needs 'image'"),
        ("plain", r"messages\[0\]\.content\[1\]: expected an object"),
    ],
)
def test_bad_content_parts_fail_naming_message_and_part(part, match):
    with pytest.raises(ValueError, match=match):
        validate_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])


def test_message_images_name_the_part_of_a_bad_image():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match=r"^request: message 0 part 0: only data URLs .* got 'http://x/y.png'"):
        message_images(msgs, base_dir=None, where="request")
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@"}}]}]
    (ref,) = message_images(bad, base_dir=None, where="request")  # decoded lazily: fails when read, named
    with pytest.raises(ValueError, match=r"^request: message 0 part 0: data URL \(23 chars\): data URL holds invalid"):
        ref.load()
    with pytest.raises(ValueError, match=r"request: message 0 part 0: type 'image' needs 'image'"):
        message_images([{"role": "user", "content": [{"type": "image"}]}], base_dir=None, where="request")
    with pytest.raises(ValueError, match=r"request: message 0 part 0: image paths are not accepted here"):
        message_images(
            [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], base_dir=None, where="request"
        )


# --- multimodal rows in the data loader ---


def write_jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_images_load_in_order_lazily_and_relative_to_the_file(tmp_path, monkeypatch):
    from miles_k3.data import PromptDataConfig, dataset_fingerprint, image_processor, load_prompts

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(b"not decoded at load")
    url = encode_data_url(b"inline")
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": f"{PH}vs{PH}?", "label": 1, "images": ["imgs/a.png", url], "extra": 7},
            {"prompt": "text only", "label": 2},
        ],
    )
    # Nothing decodes an image while loading.
    monkeypatch.setattr(image_processor, "open_image", lambda *a, **k: pytest.fail("decoded at load time"))
    r0, r1 = load_prompts(PromptDataConfig(path=str(data)))
    assert [ref.source for ref in r0.images] == [str((tmp_path / "imgs" / "a.png").resolve()), url]
    assert r0.images[1].load() == b"inline" and r0.metadata == {"extra": 7} and r1.images == ()
    # images count in the fingerprint; a text-only record hashes as before
    assert dataset_fingerprint([r0]) != dataset_fingerprint([type(r0)(0, r0.prompt, r0.raw_prompt, 1, {"extra": 7})])
    assert dataset_fingerprint([r1]) == dataset_fingerprint([type(r1)(1, "text only", "text only", 2, {})])


def test_chat_rows_take_their_images_from_content_parts(tmp_path):
    from miles_k3.data import PromptDataConfig, load_prompts

    (tmp_path / "b.png").write_bytes(b"x")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": MESSAGES, "label": 1}])
    (r,) = load_prompts(PromptDataConfig(path=str(data), chat_template="chatml"))
    assert r.prompt.count(PH) == 2 and [x.source for x in r.images] == [URL, str((tmp_path / "b.png").resolve())]


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {"prompt": PH, "label": 1, "images": ["missing.png"]},
            r"d\.jsonl line 1: key 'images' item 0: image file 'missing.png' not found",
        ),
        ({"prompt": PH, "label": 1, "images": "a.png"}, r"line 1: key 'images' must be a list of images"),
        ({"prompt": PH, "label": 1, "images": [5]}, r"line 1: key 'images' item 0: an image must be a path"),
        (
            {"prompt": f"{PH}{PH}", "label": 1, "images": ["a.png"]},
            r"line 1: the prompt has 2 image placeholder\(s\) .* but the row has 1 image\(s\)",
        ),
        ({"prompt": "no placeholder", "label": 1, "images": ["a.png"]}, r"the prompt has 0 image placeholder"),
        (
            {
                "prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}],
                "label": 1,
                "images": ["a.png"],
            },
            r"line 1: images both in the prompt's content parts \(1\) and under key 'images' \(1\)",
        ),
    ],
)
def test_bad_image_rows_fail_naming_the_record(tmp_path, row, match):
    from miles_k3.data import PromptDataConfig, load_prompts

    (tmp_path / "a.png").write_bytes(b"x")
    data = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ValueError, match=match):
        load_prompts(PromptDataConfig(path=str(data), chat_template="chatml"))


def test_images_key_none_keeps_the_key_as_metadata_and_bad_keys_fail(tmp_path):
    from miles_k3.data import PromptDataConfig, load_prompts

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "label": 1, "images": "not images"}])
    (r,) = load_prompts(PromptDataConfig(path=str(data), images_key=None))
    assert r.images == () and r.metadata == {"images": "not images"}
    with pytest.raises(ValueError, match=r"PromptDataConfig\.images_key must differ from prompt_key"):
        PromptDataConfig(path="d.jsonl", images_key="prompt")
    with pytest.raises(ValueError, match=r"PromptDataConfig\.images_key must be None or a non-empty string"):
        PromptDataConfig(path="d.jsonl", images_key="")
    with pytest.raises(ValueError, match=r"PromptDataConfig\.metadata_keys must not list the prompt, label or images"):
        PromptDataConfig(path="d.jsonl", metadata_keys=["images"])


def test_a_parquet_binary_column_holds_image_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles_k3.data import PromptDataConfig, load_prompts

    pq.write_table(pa.table({"prompt": [PH], "label": [3], "images": [[b"\x89PNG..."]]}), tmp_path / "d.parquet")
    (r,) = load_prompts(PromptDataConfig(path=str(tmp_path / "d.parquet")))
    assert r.images[0].load() == b"\x89PNG..." and r.images[0].name.endswith("image bytes (7 bytes)")
