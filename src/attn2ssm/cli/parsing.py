"""Flag values more than one command reads: comma-separated integers, a number of draft tokens."""

from __future__ import annotations

from attn2ssm.errors import ConfigError


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``1024,4096`` → ``(1024, 4096)``; positive integers only, at least one."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(
            f"{flag} {text!r} is not a comma-separated list of positive integers",
            f"write e.g. {flag} 1024,4096",
        )
    return values


def draft_tokens(flag: str, text: str) -> int | str:
    """A number of draft tokens per round (>= 1) or ``auto`` (chosen each round)."""
    text = str(text).strip()
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"{flag} {text} is not a positive number of draft tokens or 'auto'",
            f"write e.g. {flag} 4, or {flag} auto",
        )
    return int(text)
