"""Chat messages checked once, for every front door: `miles-k3 generate` rows, `miles-serve` requests and the
trainer's dataset prompts all validate a message list through `check_messages` / `check_message`.

A message is an object with a `role` in `CHAT_ROLES` and a `content` that is a string or a non-empty list of
content parts; what a part becomes (a text part's text, an image part's placeholder) is the caller's
`parts` function, since each front door reads images its own way. Every refusal is one ValueError whose
message starts with the field, `messages[1].content` or `messages[0].role`, so a server can use its first
word as the request's `param` and a file reader can put the file and line in front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

# parts(content parts, "messages[i].content") -> the content as one string; ValueError naming the part
PartsText = Callable[[list[Any], str], str]


def check_message(i: int, message: Any, parts: PartsText | None = None) -> dict[str, str]:
    """messages[i] as {role, content} with string content (keys other than role and content are dropped).
    ValueError "messages[i]..." unless it is an object, its role one of `CHAT_ROLES`, and its content present
    and a string, or a non-empty list of content parts that `parts` turns into text (None: lists refused)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with role and content, got {type(message).__name__}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {CHAT_ROLES}, got {role!r}")
    if "content" not in message or message["content"] is None:
        raise ValueError(f"{where}.content is required (a string or a list of content parts)")
    content = message["content"]
    if isinstance(content, list):
        if not content:
            raise ValueError(f"{where}.content is an empty list of content parts")
        if parts is None:
            raise ValueError(f"{where}.content must be a string here, got a list of content parts")
        content = parts(content, f"{where}.content")
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of content parts, got {type(content).__name__}")
    return {"role": role, "content": content}


def check_messages(messages: Any, parts: PartsText | None = None) -> list[dict[str, str]]:
    """A whole message list, each message by `check_message`. ValueError "messages ..." when it is not a
    non-empty list."""
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {shown}")
    return [check_message(i, m, parts) for i, m in enumerate(messages)]
