"""A tiny tokenizer with K3's special tokens, and a random-init k3-tiny checkpoint that carries it: shared by the
K3 chat tests of the data layer, the server and the trainer.

The tokenizer is byte-level (ids 0-255: one byte each, so a character outside ASCII spans several tokens, as
in K3's tiktoken vocabulary) with K3's special tokens after the bytes, in K3's order ([BOS], [EOS],
<|end_of_msg|>, <|open|>, <|close|>, <|sep|>, ...). Its generation_config.json lists the generic EOS first and
<|end_of_msg|> second, so a test sees the end of turn picked by name, not by position.

With `own_renderer`, the directory also holds remote code (loaded with trust_remote_code, as K3's is) whose
`apply_chat_template(messages, tools=, tokenize=True, add_generation_prompt=, thinking=, **kwargs)` returns ids
the way K3's tokenizer does: segments (here `miles_k3.data.k3_chat.chat_segments`, standing in for K3's
`encoding_k3.py`) encoded one by one, structure tokens as special ids and text as text. It records each call's
keyword arguments (`RenderCalls`) so a test can see that they were passed through.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_k3.data.media import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD

SPECIALS = (
    "[BOS]",
    "[EOS]",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "[UNK]",
    "[PAD]",
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
)
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}
BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP = (IDS[t] for t in SPECIALS[:6])

REMOTE = '''"""Stand-in for K3's remote tokenizer code: it renders chat itself and returns ids."""

from transformers import PreTrainedTokenizerFast

from miles_k3.data.k3_chat import chat_segments

CALLS = []  # each apply_chat_template call's keyword arguments


class TinyK3Tokenizer(PreTrainedTokenizerFast):
    def apply_chat_template(
        self, conversation, tools=None, tokenize=False, add_generation_prompt=True, thinking=True, **kwargs
    ):
        CALLS.append(dict(tools=tools, tokenize=tokenize, thinking=thinking, **kwargs))
        segments = chat_segments(
            conversation,
            tools,
            thinking=thinking,
            thinking_effort=kwargs.get("thinking_effort", "max"),
            tool_choice=kwargs.get("tool_choice"),
            image_prompts=kwargs.get("image_prompts"),
        )
        if not tokenize:
            return "".join(s.text for s in segments)
        ids = []
        for s in segments:
            ids += self.encode(s.text, add_special_tokens=False, split_special_tokens=not s.special)
        return ids
'''


def byte_tokenizer():
    """The tiny tokenizer (transformers' PreTrainedTokenizerFast over a byte-level BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)} | IDS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]"
    )


def write_k3_tokenizer(path: Path, own_renderer: bool = False) -> Path:
    """The tiny tokenizer's files (and generation_config.json) in `path`; with `own_renderer` its remote code."""
    path.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, END_OF_MSG]}))
    if own_renderer:
        (path / "tokenization_k3_tiny.py").write_text(REMOTE)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["auto_map"] = {"AutoTokenizer": [None, "tokenization_k3_tiny.TinyK3Tokenizer"]}
        config["tokenizer_class"] = "TinyK3Tokenizer"
        config_file.write_text(json.dumps(config))
    return path


def write_k3_chat_checkpoint(path: Path, own_renderer: bool = False) -> Path:
    """A random-init k3-tiny (vocabulary 512) with the tiny K3 tokenizer: [BOS], <|end_of_msg|> as the
    model's eos, [PAD]."""
    import torch

    from miles_k3.model import K3Config, K3ForCausalLM

    config = K3Config.from_preset("k3-tiny", bos_token_id=BOS, eos_token_id=END_OF_MSG, pad_token_id=IDS["[PAD]"])
    torch.manual_seed(0)
    K3ForCausalLM(config).save_pretrained(path)
    return write_k3_tokenizer(path, own_renderer)
