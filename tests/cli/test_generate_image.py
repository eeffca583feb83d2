"""`miles-k3 generate --image PATH`: a prompt with an image through the real command on a random-init
k3-tiny-vl checkpoint (text model, tower and projector, preprocessor config, a word-level tokenizer with the
media tokens) gives the reference model's greedy tokens fed the tower's features at the pads, log-probs within
1e-4; another image changes the output; bad image input stops it in one line (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_k3.cli.main import main
from miles_k3.data.media import IMAGE_PLACEHOLDER
from tests.vl_checkpoint import write_png, write_vl_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt")


@torch.no_grad()
def reference(ckpt: Path, prompt: str, images: list[Path], n: int, chat: bool = False) -> tuple[list[int], list[float]]:
    """The checkpoint's pieces by hand: processor, XTML expansion, tokenizer, tower, then the text model fed
    the features at the pads (`MediaEmbeds`), greedy."""
    from miles_k3.data.image_processor import ImageProcessor
    from miles_k3.data.media import expand_media_prompt
    from miles_k3.model import K3ForCausalLM, MediaEmbeds
    from miles_k3.model.generate import greedy_generate
    from miles_k3.model.vision import K3VisionModel
    from rollout.server.tokenization import build_server_tokenizer

    processed = [ImageProcessor.from_pretrained(ckpt).process(p) for p in images]
    tok, text = build_server_tokenizer("hf", str(ckpt)), expand_media_prompt(prompt, processed)
    ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
    vision = K3VisionModel.from_pretrained(ckpt).eval()
    feats = vision.encode(torch.cat([p.pixel_values for p in processed]), torch.tensor([p.grid_thw for p in processed]))
    model = K3ForCausalLM.from_pretrained(ckpt).eval()
    pad = model.config.media_placeholder_token_id
    pads = torch.tensor([i for i, t in enumerate(ids) if t == pad])
    assert len(pads) == feats.shape[0] > 0
    tokens, logps = greedy_generate(model, torch.tensor([ids]), n, media=MediaEmbeds(pads, feats))
    return tokens[0].tolist(), logps[0].tolist()


def generate(tmp_path: Path, ckpt: Path, rows: list[dict], *flags: str) -> list[dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "generate",
                "--model",
                str(ckpt),
                "--prompts",
                str(prompts),
                "--json",
                str(out),
                "--temperature",
                "0",
                "--quantize",
                "none",
                "--max-new-tokens",
                "6",
                "--tokenizer",
                "hf",
                *flags,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())["outputs"]


def test_an_image_prompt_equals_the_reference_and_depends_on_the_image(tmp_path, checkpoint):
    one, two = write_png(tmp_path / "a.png", 1), write_png(tmp_path / "b.png", 2)
    prompt = f"{IMAGE_PLACEHOLDER} how many red squares ?"
    rows = [{"prompt": prompt}, {"prompt": prompt}, {"messages": [{"role": "user", "content": prompt}]}]
    outs = generate(tmp_path, checkpoint, rows, "--image", str(one))
    want = reference(checkpoint, prompt, [one], 6)
    for out, w in zip(outs, [want, want, reference(checkpoint, prompt, [one], 6, chat=True)]):
        assert out["output_ids"] == w[0]
        torch.testing.assert_close(torch.tensor(out["logprobs"]), torch.tensor(w[1]), atol=1e-4, rtol=0)
    other = generate(tmp_path, checkpoint, [{"prompt": prompt}], "--image", str(two))[0]
    assert other["output_ids"] == reference(checkpoint, prompt, [two], 6)[0] != want[0]
    both = f"{IMAGE_PLACEHOLDER} how many {IMAGE_PLACEHOLDER} ?"
    pair = generate(tmp_path, checkpoint, [{"prompt": both}], "--image", str(one), "--image", str(two))[0]
    assert pair["output_ids"] == reference(checkpoint, both, [one, two], 6)[0]


@pytest.mark.parametrize(
    "rows, flags, needle",
    [
        ([{"prompt": "how many ?"}], ("--image", "{png}"), "line 1: prompt has 0 image placeholder(s)"),
        ([{"messages": [{"role": "user", "content": "?"}]}], ("--image", "{png}"), "line 1: the messages hold 0"),
        ([{"prompt": f"{IMAGE_PLACEHOLDER} ?"}], ("--image", "{missing}"), "--image"),
        ([{"prompt": f"{IMAGE_PLACEHOLDER} ?"}], ("--image", "{notpng}"), "notpng"),
    ],
)
def test_bad_image_input_is_one_line_naming_it(tmp_path, checkpoint, capsys, rows, flags, needle):
    png, notpng = write_png(tmp_path / "a.png", 3), tmp_path / "notpng.png"
    notpng.write_text("not an image")
    paths = {"png": png, "missing": tmp_path / "missing.png", "notpng": notpng}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "generate",
        "--model",
        str(checkpoint),
        "--prompts",
        str(prompts),
        "--tokenizer",
        "hf",
        *(f.format(**paths) for f in flags),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_image_needs_a_vision_language_checkpoint_and_prompts(tmp_path, capsys):
    png = write_png(tmp_path / "a.png", 4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": f"{IMAGE_PLACEHOLDER}12+3="}) + "\n")
    assert main(["generate", "--model", "builtin:k3-tiny-arith", "--prompts", str(prompts), "--image", str(png)]) == 2
    assert "not a vision-language checkpoint" in capsys.readouterr().err
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    assert main(["generate", "--model", "builtin:k3-tiny-arith", "--input-ids", str(ids), "--image", str(png)]) == 2
    assert "--image needs --prompts" in capsys.readouterr().err


def test_tensor_parallel_workers_take_the_images(tmp_path, checkpoint):
    """--tp 2: rank 0 holds the features and its followers take them over the group: one rank's output."""
    png = write_png(tmp_path / "a.png", 5)
    rows = [{"prompt": f"{IMAGE_PLACEHOLDER} how many ?"}]
    one = generate(tmp_path, checkpoint, rows, "--image", str(png))[0]
    two = generate(tmp_path, checkpoint, rows, "--image", str(png), "--tp", "2")[0]
    assert two["output_ids"] == one["output_ids"]
    torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]), atol=1e-4, rtol=0)
