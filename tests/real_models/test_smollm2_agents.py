"""The OpenAI Agents SDK against `pyserve serve` on SmolLM2-135M-Instruct's GGUF file: a triage
agent hands off to a calculator agent, which calls its function tool and answers, over the
Responses API (the SDK's default) and over Chat Completions (its chat model class); and a
conversation continued with previous_response_id."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pyserve.testing import start_server, stop_server

agents = pytest.importorskip("agents")

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def base(smollm2, tmp_path_factory):
    work = tmp_path_factory.mktemp("agents")
    proc, url = start_server(smollm2, "--max-model-len", "4096", "--tool-call-parser", "hermes",
                             "--data-dir", str(work / "data"), workdir=work)
    yield url
    stop_server(proc)


def _run(base: str, api: str) -> tuple[object, list[tuple[int, int]]]:
    """The agent run over `api` (responses or chat_completions), and the tool's calls."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[tuple[int, int]] = []

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers."""
        calls.append((a, b))
        return a * b

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = model_class(model=MODEL, openai_client=client)
    # one call a turn: asked for calls with parallel ones allowed, this small model repeats its call until max_tokens
    forced = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=96,
                           truncation="auto")  # the Responses API drops old turns past the length (chat: unsent)
    calculator = Agent(name="Calculator", instructions="Call multiply with the two numbers, then state the product.",
                       tools=[multiply], model=model, model_settings=forced)
    triage = Agent(name="Triage", instructions="Hand arithmetic questions to the Calculator.", handoffs=[calculator],
                   model=model, model_settings=forced)
    result = asyncio.run(Runner.run(triage, "What is 6 times 7?", max_turns=6))
    return result, calls


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_hands_off_calls_its_tool_and_answers(base, api):
    result, calls = _run(base, api)
    assert result.last_agent.name == "Calculator"
    assert calls == [(6, 7)]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["handoff_call_item", "handoff_output_item", "tool_call_item", "tool_call_output_item",
                     "message_output_item"]
    assert "42" in result.final_output


def test_a_conversation_continues_from_its_stored_response(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", temperature=0,
                                    max_output_tokens=24)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=24)
    resent = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == resent.choices[0].message.content
    assert second.usage.input_tokens == resent.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
