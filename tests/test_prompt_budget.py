"""The prompt diet (pyserve.prompt_budget): whole turns dropped oldest first, tool calls kept with
their results, a cut that moves in steps so the kept prompt's prefix stays the same, repeated
passages dropped, and a budget that cannot hold the newest turn refused."""

from __future__ import annotations

import pytest

from pyserve.prompt_budget import MIN_PASSAGE_CHARS, PromptBudgetError, fit_chat


def render(messages):
    """A stand-in chat template: two tokens around each message, a word a token."""
    out = []
    for m in messages:
        out += [f"<{m['role']}>", *(m.get("content") or "").split(), "</>"]
        for call in m.get("tool_calls") or []:
            out += [call["function"]["name"], *str(call["function"]["arguments"]).split()]
    return out


def count(text):
    return len(text.split())


def words(n, tag):
    return " ".join(f"{tag}{i}" for i in range(n))


def conversation(turns, size=20):
    msgs = [{"role": "system", "content": words(10, "sys")}]
    for t in range(turns):
        msgs.append({"role": "user", "content": words(size, f"u{t}-")})
        msgs.append({"role": "assistant", "content": words(size, f"a{t}-")})
    return msgs[:-1]  # the newest turn: the user's question


def test_a_prompt_within_the_budget_is_left_as_it_is():
    msgs = conversation(3)
    fitted = fit_chat(msgs, 1000, "turns", render, count)
    assert fitted.messages == msgs and fitted.token_ids == render(msgs)
    assert (fitted.diet.removed_tokens, fitted.diet.dropped_messages) == (0, 0)


def test_older_turns_are_dropped_whole_and_the_system_prompt_and_newest_turn_kept():
    msgs = conversation(10)  # 12 + 19 * 22 = 430 tokens
    fitted = fit_chat(msgs, 200, "turns", render, count)
    assert len(fitted.token_ids) <= 200 and fitted.token_ids == render(fitted.messages)
    assert fitted.messages[0] == msgs[0] and fitted.messages[-1] == msgs[-1]
    assert fitted.messages[1]["role"] == "user"  # a turn starts with its user message
    assert fitted.messages[1:] == msgs[len(msgs) - len(fitted.messages) + 1:]  # the newest, contiguous
    assert fitted.diet.removed_tokens == len(render(msgs)) - len(fitted.token_ids)
    assert fitted.diet.dropped_messages == len(msgs) - len(fitted.messages)


def test_a_tool_call_is_never_kept_without_its_result_nor_a_result_without_its_call():
    msgs = conversation(2)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"q": words(30, "q")}}}
    msgs[-1:-1] = [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": words(60, "r")},
                   {"role": "assistant", "content": words(5, "done")}]
    msgs += [{"role": "assistant", "content": words(5, "b")}, {"role": "user", "content": words(8, "new")}]
    for budget in range(40, 260, 7):
        try:
            kept = fit_chat(msgs, budget, "turns", render, count).messages
        except PromptBudgetError:
            continue
        roles = [m.get("tool_call_id") or ("call" if m.get("tool_calls") else "") for m in kept]
        assert roles.count("call") == roles.count("c1"), (budget, roles)


def test_the_kept_prefix_stays_the_same_for_several_turns_as_the_chat_grows():
    """Turn by turn the cut moves only at steps of half the budget: each prompt but those where
    it moves starts with the previous one's tokens (all but its last turn), which the prefix
    cache holds."""
    budget, moves, prompts = 300, 0, []
    for t in range(1, 40):
        fitted = fit_chat(conversation(t), budget, "turns", render, count)
        assert len(fitted.token_ids) <= budget
        prompts.append(fitted)
    for before, after in zip(prompts, prompts[1:]):
        if before.messages[1] != after.messages[1]:
            moves += 1
        else:  # same cut: the earlier prompt, less its question, is a prefix of the later one
            earlier = render(before.messages[:-1])
            assert after.token_ids[:len(earlier)] == earlier
    # 39 turns of ~44 tokens: the cut moves about every 150 tokens (half the budget), not every turn
    assert 8 <= moves <= 14, moves
    assert min(len(p.token_ids) for p in prompts[10:]) >= budget // 2 - 44


def test_repeated_passages_are_dropped_from_later_messages_under_turns_plus_repeats():
    doc = "the retrieved context " + words(20, "d")
    short = "see above"  # under MIN_PASSAGE_CHARS: kept however often it repeats
    assert len(doc) >= MIN_PASSAGE_CHARS > len(short)
    msgs = [{"role": "user", "content": f"{doc}\n\n{short}\n\nfirst question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": f"{doc}\n\n{short}\n\nsecond question"},
            {"role": "assistant", "content": "another"},
            {"role": "user", "content": doc}]  # nothing but the repeat: left whole
    fitted = fit_chat(msgs, 10_000, "turns+repeats", render, count)
    assert [m["content"] for m in fitted.messages] == [
        msgs[0]["content"], "an answer", f"{short}\n\nsecond question", "another", doc]
    assert fitted.diet.dropped_passages == 1
    assert fitted.diet.removed_tokens == count(doc)
    assert fit_chat(msgs, 10_000, "turns", render, count).messages == msgs


def test_a_budget_that_cannot_hold_the_newest_turn_is_refused_naming_its_size():
    msgs = conversation(3)
    need = len(render([msgs[0], msgs[-1]]))
    assert fit_chat(msgs, need, "turns", render, count).messages == [msgs[0], msgs[-1]]
    with pytest.raises(PromptBudgetError, match=f"take {need} tokens, over the budget of {need - 1}"):
        fit_chat(msgs, need - 1, "turns", render, count)
    with pytest.raises(ValueError, match="prompt_policy"):
        fit_chat(msgs, 100, "newest", render, count)
