"""Chat templates: the tokenizer's own for HF checkpoints, built-in ones for the embedded tiny models.

A template turns a dataset prompt into the exact string the engine tokenizes. The choices:

- ``"hf"``: the checkpoint tokenizer's own template (``apply_chat_template`` of the tokenizer config on disk,
  with the generation prompt; `miles_k3.data.hf_chat`). Renders strings (as one user message) and message
  lists. The renderer is handed in by the caller that holds the tokenizer (``render_prompt(..., apply_chat)``):
  nothing here imports transformers or reaches the network.
- ``"k3"``: K3's own chat encoding (`miles_k3.data.k3_chat`): strings (as one user message) and message lists
  (tool calls and results included), with the row's tools, rendered straight to ids by the checkpoint's
  tokenizer (its own renderer, else ours on its K3 structure tokens); the caller's ``apply_chat(messages,
  tools)`` returns a `RenderedChat`, text that carries its ids, which are never encoded again.
- ``None``: the prompt string is used verbatim (the embedded models' bare problems, or a dataset templated
  offline); a list of chat messages cannot be rendered (ValueError).
- ``"chatml"``: the built-in ChatML layout (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the
  generation prompt ``<|im_start|>assistant\\n``), for the embedded tiny models, which ship no tokenizer
  config (an HF checkpoint uses ``"hf"``; tests/data/test_hf_chat_template.py holds it equal to a ChatML
  tokenizer's own template). Renders strings (as one user message) and message lists.
- any other string: a Python format string with a ``{prompt}`` field and optionally a ``{system}`` field
  (literal braces doubled: ``{{``). Renders strings only.

A message's content is a string or a list of OpenAI-style content parts (``{"type": "text", "text"}``,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, ``{"type": "image", "image":
path}``): the parts render as one string with an image placeholder per image, so every template (the
tokenizer's too) sees plain text; `miles_k3.data.media` expands the placeholders and reads the images.
"""

from __future__ import annotations

import string
from typing import Any, Callable

from miles_k3.data.k3_chat import check_chat_messages, check_tools
from miles_k3.data.media import content_parts_text
from miles_k3.data.messages import CHAT_ROLES, check_messages

CHATML = "chatml"
HF = "hf"
K3 = "k3"
TEMPLATE_FIELDS = ("prompt", "system")
ROLES = CHAT_ROLES  # the shared validator's (miles_k3.data.messages)


def template_fields(template: str) -> set[str]:
    """Field names of a format-string template. ValueError on malformed braces, unknown fields, format specs
    or conversions (``{prompt!r}``, ``{prompt:>10}``): they would change the prompt text in ways that are easy
    to miss."""
    fields: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # unbalanced braces
        raise ValueError(f"chat_template: malformed format string {template!r}: {e}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS:
            raise ValueError(
                f"chat_template: unknown field {{{name}}} in {template!r}; allowed: "
                f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (double literal braces)"
            )
        if spec or conversion:
            raise ValueError(f"chat_template: field {{{name}}} may not carry a format spec or conversion")
        fields.add(name)
    return fields


def validate_template(template: str | None, system_prompt: str | None) -> None:
    """ValueError (naming ``chat_template`` or ``system_prompt``) unless the pair can render prompts and the
    system prompt would actually be used: a set system prompt that no template reads is an error, not a
    silent no-op."""
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"chat_template: must be None, {HF!r}, {K3!r}, {CHATML!r} or a format string, got {type(template).__name__}"
        )
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt: must be None or a string, got {type(system_prompt).__name__}")
    if template is None:
        if system_prompt is not None:
            raise ValueError(
                "system_prompt: set, but chat_template is None, so it would be ignored; "
                "use chat_template='hf', 'k3', 'chatml' or a format string with {system}"
            )
        return
    if template in (CHATML, HF, K3):
        return
    fields = template_fields(template)
    if "prompt" not in fields:
        raise ValueError(
            f"chat_template: {template!r} is neither {HF!r}, {CHATML!r} nor a format string with a {{prompt}} field"
        )
    if system_prompt is not None and "system" not in fields:
        raise ValueError("system_prompt: set, but chat_template has no {system} field, so it would be ignored")


def validate_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Check a chat-message list and return it as ``[{role, content}]`` with string content (keys other than
    role and content, e.g. a parquet struct's extra fields, are dropped; a list of content parts becomes text
    with an image placeholder per image, `content_parts_text`). The checks are the shared ones of every front
    door (`miles_k3.data.messages.check_messages`); ValueError "prompt: messages[i]..." names the message.
    The last message must come from the user: an RL prompt asks for the assistant's next turn."""
    try:
        out = check_messages(messages, content_parts_text)
    except ValueError as e:
        text = str(e)
        raise ValueError(text if text.startswith("prompt: ") else f"prompt: {text}") from None
    if out[-1]["role"] != "user":
        raise ValueError(f"prompt: the last message must have role 'user', got {out[-1]['role']!r}")
    return out


def with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The configured system prompt first, unless the record has its own (the dataset author put it there)."""
    if system_prompt is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}] + messages
    return messages


def _chatml(messages: list[dict[str, str]], system_prompt: str | None) -> str:
    messages = with_system(messages, system_prompt)
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def render_prompt(
    raw: str | list[Any],
    template: str | None,
    system_prompt: str | None = None,
    apply_chat: Callable[..., str] | None = None,
    tools: list[Any] | None = None,
) -> str:
    """Render a raw prompt (string or chat-message list) with a template already checked by
    `validate_template`. `apply_chat`: the tokenizer's template (messages -> text ending in the generation
    prompt), required by ``"hf"``; under ``"k3"`` (messages, tools) -> a `RenderedChat`. `tools`: the tools
    offered (``"k3"`` only). ValueError when the template cannot render this prompt (messages without a chat
    template, an empty string, a malformed message or tool); the caller adds file and line."""
    if tools is not None and template != K3:
        raise ValueError(f"tools: only chat_template {K3!r} renders tools; chat_template is {template!r}")
    if template == K3:
        if apply_chat is None:
            raise ValueError("chat_template: 'k3' renders with the tokenizer's K3 chat encoding, and none was given")
        if isinstance(raw, str) and raw:
            raw = [{"role": "user", "content": raw}]
        if not isinstance(raw, list):
            raise ValueError(f"prompt: must be a non-empty string or a list of chat messages, got {raw!r}"[:120])
        try:
            messages = with_system(check_chat_messages(raw), system_prompt)
        except ValueError as e:
            raise ValueError(f"prompt: {e}") from None
        if messages[-1]["role"] not in ("user", "tool"):
            raise ValueError(f"prompt: the last message must have role 'user' or 'tool', got {messages[-1]['role']!r}")
        return apply_chat(messages, check_tools(tools) if tools is not None else None)
    if template == HF:
        if apply_chat is None:
            raise ValueError("chat_template: 'hf' renders with the tokenizer's own template, and none was given")
        if isinstance(raw, str) and not raw:
            raise ValueError("prompt: empty string")
        messages = validate_messages(raw) if isinstance(raw, list) else None
        if messages is None and not isinstance(raw, str):
            raise ValueError(f"prompt: must be a string or a list of chat messages, got {type(raw).__name__}")
        return apply_chat(with_system(messages or [{"role": "user", "content": raw}], system_prompt))
    if isinstance(raw, list):
        messages = validate_messages(raw)
        if template != CHATML:
            raise ValueError(
                f"prompt: a chat-message list needs chat_template={CHATML!r} (embedded models) or "
                f"{HF!r} (an HF tokenizer's own); chat_template is {template!r}"
            )
        return _chatml(messages, system_prompt)
    if not isinstance(raw, str):
        raise ValueError(f"prompt: must be a string or a list of chat messages, got {type(raw).__name__}")
    if not raw:
        raise ValueError("prompt: empty string")
    if template is None:
        return raw
    if template == CHATML:
        return _chatml([{"role": "user", "content": raw}], system_prompt)
    # str.format never re-parses substituted values, so braces inside the prompt text are safe.
    return template.format(prompt=raw, system=system_prompt if system_prompt is not None else "")
