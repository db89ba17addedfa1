"""What the cache embeds of a conversation: its user messages (the server's chat cache keeps every
other message in the exact scope instead), role by role, reduced to its content words
(guard.content_words).
A static embedding averages its tokens, so framing words ("how do I", "show me") would otherwise
outweigh the few words that carry the question."""

from __future__ import annotations

from pyserve.semantic_cache.guard import content_words


def conversation_text(messages: list[tuple[str, str]]) -> str:
    """(role, text) pairs: the user's, as one text."""
    return "\n".join(f"{role}: {text}" for role, text in messages if role == "user")


def question_text(text: str) -> str:
    return " ".join(content_words(text))
