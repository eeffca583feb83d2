"""Text <-> token ids for the server: prompts, chat messages, and decoding a stream of tokens.

Built on the run's tokenizers (`miles_k3.data.tokenizers.load_tokenizer`, wrapped by `server_tokenizer`:
a caller that already holds the run's tokenizer does not load it again), so a prompt string becomes the
same ids in a training run and in a request: the arithmetic tokenizer adds `<bos>`; an HF tokenizer adds
its special tokens (`add_special_tokens=True`).

Chat messages (checked by `rollout.server.images.message_text`): an HF checkpoint's own template
(`apply_chat_template` of its tokenizer config, with the generation prompt), whose text is encoded without
adding special tokens again (the template writes them). A tokenizer that speaks K3's chat (its structure
tokens, and its own renderer or no Jinja template: `miles_k3.data.k3_chat.K3Chat.detect`) renders messages
straight to ids (`K3ServerTokenizer`), its eos is the checkpoint's end-of-turn token, and `chat` parses replies
into reasoning, content and tool calls for the chat API.
The embedded arithmetic models were pretrained on bare problems (`12+3=`), so their "template" is the
messages' contents concatenated, then encoded as a prompt.

Decoding is incremental (`Decoder`): text arrives as tokens do, never a partial UTF-8 character. Every
error a request can cause is a ValueError whose message the HTTP layer returns as a 400.
"""

from __future__ import annotations

import re

from miles_k3.data.k3_chat import K3Chat, chat_of
from miles_k3.data.media import IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_END
from miles_k3.data.messages import check_messages
from miles_k3.data.tokenizers import ArithmeticTextTokenizer, Decoder, HFTokenizer, Tokenizer, load_tokenizer


class ServerTokenizer:
    """The interface the server needs; `build_server_tokenizer` picks the implementation."""

    eos_token_id: int
    name_or_path: str
    chat: K3Chat | None = None  # K3's chat encoding (`K3ServerTokenizer`); None: the chat API returns plain text

    def encode(self, text: str) -> list[int]:
        """A prompt string -> ids, special tokens added as training adds them."""
        raise NotImplementedError

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages -> the prompt ids that ask for the assistant's next turn; ValueError "messages..."
        from the shared validator (`miles_k3.data.messages.check_messages`) for a malformed list."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def decoder(self, skip_special_tokens: bool = True) -> Decoder:
        return Decoder(lambda ids: self.decode(ids, skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token's text as logprob listings show it (special tokens included)."""
        return self.decode([token_id], skip_special_tokens=False)


class ArithmeticServerTokenizer(ServerTokenizer):
    """The embedded models' character tokenizer (the run's `ArithmeticTextTokenizer`). Its special tokens
    have no text (`<eos>` ends decoding), so `skip_special_tokens` changes nothing here."""

    def __init__(self, tok: ArithmeticTextTokenizer, name_or_path: str):
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self.name_or_path = name_or_path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode_prompt(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        messages = check_messages(messages)
        return self._tok.encode_prompt("".join(m["content"] for m in messages))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids)

    def decoder(self, skip_special_tokens: bool = True) -> Decoder:
        return _CharDecoder(self._tok.decode, self.eos_token_id)


class _CharDecoder(Decoder):
    """One character per token, text ending at `<eos>` (as `decode` reads a whole sequence): no window to
    keep, and an id outside the vocabulary (U+FFFD) is final, not a partial character."""

    def __init__(self, decode, eos_token_id: int):
        super().__init__(decode)
        self._eos, self._ended = eos_token_id, False

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        out = []
        for t in ids:
            self._ended = self._ended or t == self._eos
            if self._ended:
                break
            out.append(self._decode([t]))
        return "".join(out)

    def finish(self) -> str:
        return ""


class HFServerTokenizer(ServerTokenizer):
    """transformers' AutoTokenizer of the checkpoint (the run's `HFTokenizer`), with its chat template."""

    def __init__(self, base: HFTokenizer, path: str):
        self._base, self._hf = base, base.hf
        self.eos_token_id = base.eos_token_id
        self.name_or_path = path

    def encode(self, text: str) -> list[int]:
        return self._base.encode_prompt(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        messages = check_messages(messages)
        if not getattr(self._hf, "chat_template", None):
            raise ValueError(
                f"the tokenizer in {self.name_or_path} has no chat template; "
                "send the prompt text to /v1/completions instead"
            )
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja's own errors (a template that rejects a role order, raise_exception)
            raise ValueError(f"messages: the chat template rejected them: {e}") from None
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._base.decode(ids, skip_special_tokens)


_MEDIA_BLOCK = re.compile(re.escape(MEDIA_BEGIN) + ".*?" + re.escape(MEDIA_END), re.DOTALL)


class K3ServerTokenizer(HFServerTokenizer):
    """An HF tokenizer that speaks K3's chat (`miles_k3.data.k3_chat`): messages render straight to ids
    (thinking on, K3's default; the chat API passes its own choice to `chat.render`), and the eos is the
    checkpoint's end-of-turn token (`K3Chat.end_of_turn_id`), where a reply ends."""

    def __init__(self, base: HFTokenizer, path: str, chat: K3Chat):
        super().__init__(base, path)
        self.chat = chat
        self.eos_token_id = chat.end_of_turn_id

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """K3's rendering of `messages`; the XTML media blocks `prompt_encoder` expanded its image placeholders
        to go back in as K3's image prompts (special tokens), not as text."""
        blocks: list[str] = []

        def take(m: re.Match) -> str:
            blocks.append(m.group(0))
            return IMAGE_PLACEHOLDER

        messages = [
            {**m, "content": _MEDIA_BLOCK.sub(take, m["content"])} if isinstance(m.get("content"), str) else m
            for m in messages
        ]
        return self.chat.render(messages, image_prompts=blocks or None)


def server_tokenizer(tok: Tokenizer, path: str) -> ServerTokenizer:
    """The server's view of an already-loaded run tokenizer (`miles_k3.data.tokenizers.load_tokenizer`)."""
    if isinstance(tok, ArithmeticTextTokenizer):
        return ArithmeticServerTokenizer(tok, path)
    chat = chat_of(tok)
    return HFServerTokenizer(tok, path) if chat is None else K3ServerTokenizer(tok, path, chat)


def build_server_tokenizer(kind: str, path: str | None, name: str | None = None) -> ServerTokenizer:
    """kind: "arithmetic" or "hf" (`miles_k3.data.tokenizers.TOKENIZERS`); path: the checkpoint directory (None:
    a preset); name: how /get_model_info names it (default: path)."""
    return server_tokenizer(load_tokenizer(kind, path), name if name is not None else str(path))
