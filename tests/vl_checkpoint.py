"""A random-init k3-tiny-vl checkpoint on disk, as a vision-language HF checkpoint is laid out (text model,
tower and projector, preprocessor_config.json, a word-level tokenizer with the media tokens and a plain chat
template), and small PNG pictures: shared by the generate, server and RL image tests."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_k3.data.media import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD

WORDS = ("how", "many", "red", "squares", "?", "image")


def write_vl_checkpoint(path: Path, words: tuple[str, ...] = WORDS) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from miles_k3.data.image_processor import ImageProcessorConfig
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.vision import K3VisionModel

    config = K3Config.from_preset("k3-tiny-vl")
    torch.manual_seed(0)
    text = K3ForCausalLM(config)
    K3VisionModel(config.vision_config).save_pretrained(path, text=text)
    ImageProcessorConfig(
        patch_size=14,
        merge_kernel_size=(2, 2),
        in_patch_limit=256,
        patch_limit_on_one_side=16,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    ).save_pretrained(path)
    special = [MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END]
    vocab = {
        "<pad>": 0,
        "<bos>": 1,
        "<eos>": 2,
        MEDIA_PAD: config.media_placeholder_token_id,
        "<unk>": 4,
        **{t: 5 + i for i, t in enumerate(special)},
        **{w: 8 + i for i, w in enumerate(words)},
    }
    assert len(vocab) <= config.vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=[MEDIA_PAD, *special],
    )
    hf.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    hf.save_pretrained(path)
    return path


def write_png(path: Path, seed: int, size: tuple[int, int] = (56, 42)) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return path
