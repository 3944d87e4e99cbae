"""A request's affinity key: where its prompt's KV cache is likely to be (docs/design.md §5,
Affinity). No I/O.

vLLM and llama.cpp reuse the KV cache of a prompt prefix they have computed before, so the
turns of one conversation, and the requests that share a long system prompt, are cheaper on
the backend that served the last of them. Placement sends a request with a key to the
backend its key ranks first (``placement.py``); this module makes the key:

- a **session** the client names (a configured header, or the body's ``user`` field when the
  pool says so) wins;
- else the **prompt's prefix**: for a chat, the messages before the first ``assistant`` one
  (role and text, in order, the system prompt first), for a completion its (first) prompt,
  cut to the pool's ``prefix_chars``. Stopping at the first answer keeps the key of a
  conversation the same from one turn to the next (its first turn has no answer yet, its
  later turns start with the same messages), and a huge prompt costs only ``prefix_chars``.

Both are scoped to the org (``request_key``).

A key is 16 hex digits of a SHA-256: no text of a request, and no secret, is ever kept in
it, nor in the shared state, logs or metrics that carry it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

DIGEST_CHARS = 16  # 64 bits: collisions only merge two keys' placement, never their data


class Settings(Protocol):
    """What parsing needs of a pool's ``affinity`` section (``config.AffinitySpec``)."""

    @property
    def prefix_chars(self) -> int: ...

    @property
    def use_user_field(self) -> bool: ...


def digest(kind: str, text: str) -> str:
    """16 hex digits of SHA-256 over ``kind`` and ``text`` (any string a header or a body
    can hold, surrogate escapes included)."""
    data = f"{kind}\0{text}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def chat_prefix(messages: Iterable[tuple[str, str]], chars: int) -> str:
    """The first ``chars`` characters of ``(role, text)`` messages up to the first
    ``assistant`` one, each as its role, a newline, its text and a blank line."""
    out: list[str] = []
    left = chars
    for role, text in messages:
        if role == "assistant" or left <= 0:
            break
        piece = f"{role}\n{text[:left]}\n\n"[:left]
        out.append(piece)
        left -= len(piece)
    return "".join(out)


def prompt_prefix(prompt: object, chars: int) -> str:
    """The first ``chars`` characters of a completion's (first) prompt; token ids are
    written as decimal numbers separated by commas."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:chars]
    if isinstance(prompt, list):
        return ",".join(str(token) for token in prompt[:chars])[:chars]
    return ""


def prefix_key(prefix: str) -> str | None:
    """The key of a prompt prefix; None when it is empty (nothing to be cached)."""
    return digest("p", prefix) if prefix else None


def request_key(org: str, header: str | None, user: str | None, prefix: str | None) -> str | None:
    """A request's key: the session its ``header`` names, else the one its body's ``user``
    names (``user`` is that field's digest), else its ``prefix`` key; None when it has none
    of them. Each in ``org``'s name space: two orgs' session "1" are two sessions, and two
    orgs' identical prompts are not steered to one backend, where one could tell from its
    time to first token that the other's prefix is cached (vLLM's cache is shared by every
    request on a server): placement exposes no more than least-loaded does."""
    if header:
        return digest("s", f"{org}\0h\0{header}")
    if user is not None:
        return digest("s", f"{org}\0u\0{user}")
    if prefix is not None:
        return digest("o", f"{org}\0{prefix}")
    return None
