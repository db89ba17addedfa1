"""The text a request is routed by: what its prompt starts with, as the replica will see it, in
a form whose prefixes are shared exactly when the prompts' prefixes are."""

from __future__ import annotations


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_text(path: str, body) -> str:
    """Chat: each message as role and content, in order; completions: the (first) prompt, token
    ids written out; embeddings: the (first) input. "" for a body of another shape (the replica
    answers it, with its own error if it is bad)."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"\x1e{m.get('role')}\x1f{_content_text(m.get('content'))}"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts: by its first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)) + " "
    return ""
