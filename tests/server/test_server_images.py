"""Images through the HTTP server: a live server on a random k3-tiny-vl checkpoint (text model, tower and
projector, preprocessor config, a word-level tokenizer with the media tokens) answers OpenAI `image_url`
content parts (data URLs) and SGLang's `image_data` with the reference model's greedy tokens fed the tower's
features at the pads; another image gives another answer and shares no cache past its first pad; every bad
image input is a 400 naming the part; a text-only model refuses images."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
import torch

from miles_k3.data.media import IMAGE_PLACEHOLDER, encode_data_url
from rollout.server.config import ServeConfig
from tests.cli.test_generate_image import reference
from tests.server.common import MODEL, serve
from tests.vl_checkpoint import write_png, write_vl_checkpoint

QUESTION = " how many red squares ?"
SIZE = (224, 224)  # 16 x 16 patches: 64 pads, so the prompt spans a whole 64-token cache chunk


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt")


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    d = tmp_path_factory.mktemp("png")
    return [write_png(d / f"{i}.png", 10 + i, SIZE) for i in range(2)]


@pytest.fixture(scope="module")
def vl_server(checkpoint):
    cfg = ServeConfig(model=str(checkpoint), tokenizer="hf", quantize="none", port=0, max_seq_len=256, memory_mb=16.0)
    s = serve(cfg)
    yield s
    s.stop()


def url_of(path) -> str:
    return encode_data_url(path.read_bytes())


def chat_body(image_url: str, model: str, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": QUESTION}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
        **extra,
    }


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def want(checkpoint, pngs):
    """The reference's greedy (tokens, log-probs) per image, through the chat template and bare."""
    prompt = f"{IMAGE_PLACEHOLDER}{QUESTION}"
    return {
        (i, chat): reference(checkpoint, prompt, [p], 6, chat=chat)
        for i, p in enumerate(pngs)
        for chat in (True, False)
    }


def tokens_of(server, text: str) -> list[int]:
    return server.ctx.tokenizer.encode(text)


def test_chat_image_url_greedy_equals_the_reference_fed_the_features(vl_server, pngs, want, checkpoint):
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = chat_body(url_of(pngs[0]), str(checkpoint))
    r = client.chat.completions.create(
        model=str(checkpoint),
        messages=body["messages"],
        temperature=0,
        max_tokens=6,
        n=2,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    ids, lps = want[0, True]  # the chat API shows token texts, most of them "" here: the log-probs tell
    tok = vl_server.ctx.tokenizer
    for choice in r.choices:
        assert [c.token for c in choice.logprobs.content] == [tok.token_text(t) for t in ids]
        torch.testing.assert_close(
            torch.tensor([c.logprob for c in choice.logprobs.content]), torch.tensor(lps), atol=1e-4, rtol=0
        )
    # streamed: the same tokens
    got, got_lps = [], []
    for chunk in client.chat.completions.create(
        model=str(checkpoint),
        messages=body["messages"],
        temperature=0,
        max_tokens=6,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            got += [c.token for c in chunk.choices[0].logprobs.content]
            got_lps += [c.logprob for c in chunk.choices[0].logprobs.content]
    assert got == [tok.token_text(t) for t in ids]
    torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(lps), atol=1e-4, rtol=0)


def test_images_in_message_order_each_content_encoded_once(vl_server, checkpoint, tmp_path):
    """[a] text [b, a] over two messages, n = 2: the reference fed a, b, a; the tower ran once per content."""
    from tests.server.common import run_on_loop

    a, b = write_png(tmp_path / "a.png", 40, (56, 42)), write_png(tmp_path / "b.png", 41, (42, 56))

    def image(p):
        return {"type": "image_url", "image_url": {"url": url_of(p), "detail": "low"}}

    messages = [
        {"role": "system", "content": [image(a), {"type": "text", "text": " how"}]},
        {"role": "user", "content": [{"type": "text", "text": " many"}, image(b), image(a)]},
    ]
    before = run_on_loop(vl_server, lambda e: e.media.encoded_images)
    r = post(
        vl_server,
        "/v1/chat/completions",
        {
            "model": str(checkpoint),
            "messages": messages,
            "temperature": 0,
            "max_tokens": 6,
            "n": 2,
            "logprobs": True,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    assert run_on_loop(vl_server, lambda e: e.media.encoded_images) - before == 2
    # the template writes each message's content then a space: one user message of the joined text renders alike
    want = reference(
        checkpoint, f"{IMAGE_PLACEHOLDER} how  many{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", [a, b, a], 6, chat=True
    )
    for choice in r.json()["choices"]:
        got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
        torch.testing.assert_close(got, torch.tensor(want[1]), atol=1e-4, rtol=0)


def test_sglang_image_data_equals_the_reference(vl_server, pngs, want):
    for image in (url_of(pngs[1]), base64.b64encode(pngs[1].read_bytes()).decode()):  # a data URL, raw base64
        r = post(
            vl_server,
            "/generate",
            {
                "text": f"{IMAGE_PLACEHOLDER}{QUESTION}",
                "image_data": [image],
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want[1, False][0]
    # a batch: one image_data entry per text, null for a text without images
    r = post(
        vl_server,
        "/generate",
        {
            "text": [f"{IMAGE_PLACEHOLDER}{QUESTION}", QUESTION.strip()],
            "image_data": [[url_of(pngs[0])], None],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == want[0, False][0]


def test_another_image_answers_otherwise_and_shares_no_cache_past_its_first_pad(vl_server, checkpoint, tmp_path):
    """Two images no earlier test sent: the second shares the first's text prefix only, the first again
    resumes inside its image."""
    a, b = (url_of(write_png(tmp_path / f"{i}.png", 30 + i, SIZE)) for i in range(2))
    model = str(checkpoint)
    first, other, again = (
        post(vl_server, "/v1/chat/completions", chat_body(u, model, logprobs=True)) for u in (a, b, a)
    )
    assert first.status_code == other.status_code == again.status_code == 200, (first.text, other.text)

    def logprobs(r):  # the tiny word-level vocabulary writes most tokens as "": their log-probs tell them apart
        return torch.tensor([c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]])

    torch.testing.assert_close(logprobs(again), logprobs(first), atol=1e-4, rtol=0)
    assert (logprobs(other) - logprobs(first)).abs().max() > 1e-3
    first_pad = tokens_of(vl_server, "<|media_begin|>image 224x224<|media_content|><|media_pad|>").index(
        vl_server.ctx.media_pad_id
    )
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, other, again)]
    assert cached[0] == 0 and cached[1] <= first_pad < cached[2]  # the other image stops at its first pad


def png_bytes_corrupt() -> str:
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG but not really").decode()


@pytest.mark.parametrize(
    "content, param, needle",
    [
        (
            [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
            "messages[0].content[0].image_url",
            "only data URLs",
        ),
        ([{"type": "image_url", "image_url": {"url": png_bytes_corrupt()}}], "messages[0].content[0].image_url", ""),
        (
            [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}],
            "messages[0].content[0].image_url",
            "image/*",
        ),
        ([{"type": "image_url", "image_url": {}}], "messages[0].content[0].image_url.url", "is required"),
        (
            [{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}],
            "messages[0].content[1]",
            "'input_audio'",
        ),
        (
            [{"type": "text", "text": f"{IMAGE_PLACEHOLDER} ?"}, {"type": "image_url", "image_url": {"url": "{png}"}}],
            "messages",
            "image placeholder",
        ),
    ],
)
def test_bad_image_parts_are_a_400_naming_the_part(vl_server, pngs, content, param, needle):
    content = json.loads(json.dumps(content).replace('"{png}"', json.dumps(url_of(pngs[0]))))
    body = {"model": vl_server.ctx.model_name, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = post(vl_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and "\n" not in err["message"], err
    assert err["message"].startswith(param), err


def test_a_text_only_model_refuses_images(server, pngs):
    """The session's embedded arithmetic server (no vision_config)."""
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "1+1="},
                    {"type": "image_url", "image_url": {"url": url_of(pngs[0])}},
                ],
            }
        ],
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url" and "takes no images" in err["message"], err
    r = post(server, "/generate", {"text": "1+1=", "image_data": url_of(pngs[0])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text
    # its text path is as before
    ok = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "1+1="}]}],
            "max_tokens": 2,
        },
    )
    assert ok.status_code == 200, ok.text


def test_sglang_image_data_errors_name_the_field(vl_server, pngs):
    good = url_of(pngs[0])
    cases = [
        ({"text": f"{IMAGE_PLACEHOLDER}{QUESTION}", "image_data": ["http://x/a.png"]}, "image_data[0]"),
        ({"text": f"{IMAGE_PLACEHOLDER}{QUESTION}", "image_data": ["!!notbase64"]}, "image_data[0]"),
        ({"text": QUESTION, "image_data": [good]}, "text"),
        ({"input_ids": [5, 6], "image_data": [good]}, "image_data"),
    ]
    for body, param in cases:
        r = post(vl_server, "/generate", {**body, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_a_vl_checkpoint_without_its_preprocessor_config_fails_at_load_naming_the_file(checkpoint, tmp_path):
    from rollout.server.loading import load_served

    bare = tmp_path / "ckpt"
    bare.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "preprocessor_config.json":
            (bare / f.name).symlink_to(f)
    with pytest.raises(ValueError, match="preprocessor_config.json: not found"):
        load_served(ServeConfig(model=str(bare), tokenizer="hf", quantize="none", port=0))
