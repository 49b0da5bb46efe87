"""Token estimates made before an engine has seen the text.

The ingress has no tokenizer of the served model; it estimates (about four characters a
token for code and English) to check sizes and reserve budget. Engines report the real
counts, and usage events carry those.
"""

from __future__ import annotations

__all__ = ["estimate_tokens"]

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN
