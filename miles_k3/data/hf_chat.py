"""Chat prompts through an HF checkpoint's own template (data.chat_template "hf").

The template is the tokenizer's (`apply_chat_template` of the tokenizer config in the checkpoint directory,
loaded from disk: nothing here reaches the network), rendered to text with the generation prompt, so a
dataset row becomes exactly what the model was tuned to read. The rendered text already holds the template's
special tokens (a BOS, role markers), so it is encoded without adding them again (`TemplatedPrompts`).
"""

from __future__ import annotations

from typing import Any, Callable

from miles_k3.data.k3_chat import K3Chat


def hf_chat_renderer(hf_tokenizer: Any, where: str) -> Callable[[list[dict[str, str]]], str]:
    """messages -> the prompt text asking for the assistant's next turn, by the tokenizer's template.
    ValueError (starting with ``chat_template``) when the tokenizer has none; a template that rejects a message
    list (jinja's raise_exception, a role order it refuses) is a ValueError starting with ``prompt``."""
    if not getattr(hf_tokenizer, "chat_template", None):
        if K3Chat.detect(hf_tokenizer) is not None:
            raise ValueError(
                f"chat_template: 'hf', but the tokenizer in {where} renders K3's chat itself (no Jinja "
                "template): use chat_template=k3"
            )
        raise ValueError(
            f"chat_template: 'hf', but the tokenizer in {where} has no chat template "
            "(tokenizer_config.json's chat_template, or chat_template.jinja)"
        )

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja's own errors
            raise ValueError(f"prompt: the tokenizer's chat template rejected the messages: {e}") from None

    return render


class TemplatedPrompts:
    """The run's HF tokenizer for prompts its chat template rendered: `encode_prompt` adds no special tokens
    (the template wrote them); decoding and the eos are the tokenizer's."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode_prompt(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)
