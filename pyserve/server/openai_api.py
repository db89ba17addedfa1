"""The OpenAI endpoints: /v1/chat/completions and /v1/completions, streaming (SSE) or not.

A request is validated, templated and tokenized, checked against the model length, then queued
as one engine request per prompt; a CompletionContext serves it from there (SSE or one body),
building its chunks and body as its endpoint reads (ChatBody, TextBody).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from starlette.requests import Request
from starlette.responses import Response

from pyserve.actors import EngineDeadError
from pyserve.embeddings.encoder import embed_texts
from pyserve.step.sampling_params import SamplingParams, truncate_prompt
from pyserve.lora.request import LoRARequest
from pyserve.model.tokenizer import ChatTemplateError
from pyserve.model_choice.classifier import routed_text
from pyserve.prompt_budget import Diet, PromptBudgetError, fit_chat
from pyserve.http import sse
from pyserve.http.responses import json_body, json_response
from pyserve.server.body import check_token_ids, validate
from pyserve.server.chat_cache import HEADER, CachePlan, hit_body
from pyserve.server.chat_body import ChatBody
from pyserve.server.completion_context import REQUEST_ID_HEADER, CompletionContext
from pyserve.server.deadline import DeadlineExceeded, run_with_deadline
from pyserve.http.errors import BadRequest, NotFound, TooManyRequests, Unavailable
from pyserve.server.decision import serve_decided
from pyserve.server.models import RouteSpec, ServedModel
from pyserve.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from pyserve.server.state import ServerState
from pyserve.server.tool_calls import plan_tools
from pyserve.structured.params import GrammarError, StructuredOutputsParams
from pyserve.tools.formats import FORMATS, ToolFormat, detect
from pyserve.server.replay import replayed
from pyserve.server.text_body import TextBody


log = structlog.get_logger("pyserve.server")


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    return await serve_chat(request, state, validate(ChatCompletionRequest, await json_body(request)))


async def serve_chat(request: Request, state: ServerState, req: ChatCompletionRequest) -> Response:
    """A chat request's response (its SSE stream, or its body once finished), on whichever model,
    adapter, route or cascade it names; the Responses API serves its requests through it."""
    route = state.models.routes.get(req.model)
    if route is not None:
        text = routed_text([(m.role, m.text()) for m in req.messages])
        return await _decided(request, state, route, req, text, _chat_on)
    model, lora = state.models.resolve(req.model)
    cache_plan = None
    if state.cache is not None:
        cache_plan = await state.cache.plan(request, req, req.model)
        found = None if cache_plan is None else state.cache.lookup(cache_plan)
        if found is not None:
            state.metrics.cache_lookup.observe(found.seconds)
            if found.entry is not None:
                return _cache_hit(state, req, model, found.entry)
    return await _answer(request, state, await _chat_on(state, model, lora, req, cache_plan))


async def _answer(request: Request, state: ServerState, ctx: CompletionContext) -> Response:
    """A started request's response: its SSE stream, or its body once it finished."""
    if ctx.req.stream:
        return sse.TimedStreamingResponse(ctx.sse(), state.settings.stream_timeout, ctx.slow_client, ctx.headers())
    return await ctx.respond(request)


async def _decided(request: Request, state: ServerState, route: RouteSpec, req: SamplingFields, text: str,
                   serve_on) -> Response:
    """A request naming a route or cascade, served on the model it picks (server.decision)."""
    async def embed(t: str):
        return (await asyncio.to_thread(embed_texts, state.encoder, [t]))[0]

    async def answer_on(model: ServedModel, r: SamplingFields) -> Response:
        return await _answer(request, state, await serve_on(state, route.serving(model), None, r))

    async def result_on(model: ServedModel, r: SamplingFields):
        return await (await serve_on(state, route.serving(model), None, r)).result(request)

    return await serve_decided(route, state.models, req, lambda: text, embed, answer_on, result_on, state.metrics,
                               state.settings.stream_timeout)


async def _chat_on(state: ServerState, model: ServedModel, lora: LoRARequest | None,
                   req: ChatCompletionRequest, cache_plan: CachePlan | None = None) -> CompletionContext:
    tok = model.engine.tokenizer
    settings = state.settings
    param = "messages" if req.chat_template is None else "chat_template"
    if req.chat_template is not None and not settings.trust_request_chat_template:
        raise BadRequest("chat_template: this server renders only the model's chat template "
                         "(start it with --trust-request-chat-template to accept one per request)", param=param)
    plan = plan_tools(req, _tool_format(settings, req.chat_template or tok.chat_template), tok.single_tokens)
    budget = _prompt_budget(model, req)

    def prompt_of(messages: list[dict]) -> list[int]:
        return tok.chat_prompt(messages, req.add_generation_prompt, req.chat_template, plan.template_tools,
                               req.continue_final_message, req.chat_template_kwargs)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    diet = None
    try:  # in a thread, under a deadline: the event loop keeps serving while a template renders
        messages = req.template_messages()
        if model.policy.concise:
            messages = _with_instruction(messages, settings.concise_instruction)
        if budget is None:
            prompt = await run_with_deadline(prompt_of, messages, timeout=settings.chat_template_timeout)
        else:
            fitted = await run_with_deadline(fit_chat, messages, *budget, prompt_of, count,
                                             timeout=settings.chat_template_timeout)
            prompt, diet = fitted.token_ids, fitted.diet
    except ChatTemplateError as e:
        raise BadRequest(str(e), param=param) from e
    except PromptBudgetError as e:
        raise BadRequest(str(e), param="max_prompt_tokens") from e
    except DeadlineExceeded as e:
        raise BadRequest(f"the chat template did not render within {settings.chat_template_timeout} s",
                         param=param) from e
    max_tokens = req.max_completion_tokens or req.max_tokens
    shape = ChatBody(tok, req.top_logprobs or 0, plan)
    return await _serve(state, model, shape, req, [prompt], max_tokens, req.num_logprobs(), lora,
                        plan.constraint, plan.field, cache_plan=cache_plan, diet=diet)


def _prompt_budget(model: ServedModel, req: SamplingFields) -> tuple[int, str] | None:
    """The request's prompt budget and chat policy: its own max_prompt_tokens (no more than the
    model's) or the model's; None where neither gives one."""
    own, asked = model.policy.max_prompt_tokens, req.max_prompt_tokens
    if asked is not None and own is not None and asked > own:
        raise BadRequest(f"max_prompt_tokens: {asked} is more than the prompt budget of {own} for {model.name!r} "
                         "(--max-prompt-tokens, or its models file entry)", param="max_prompt_tokens")
    policy = getattr(req, "prompt_policy", None)
    if asked is None and own is None:
        if policy is not None:
            raise BadRequest("prompt_policy: needs a prompt budget (max_prompt_tokens, the request's or the "
                             "model's)", param="prompt_policy")
        return None
    return asked or own, policy or model.policy.prompt_policy


def _with_instruction(messages: list[dict], instruction: str) -> list[dict]:
    """`messages` (as templates take them: text content) with `instruction` after their first
    system (or developer) message's text, or in a system message of its own before them."""
    if not messages or messages[0]["role"] not in ("system", "developer"):
        return [{"role": "system", "content": instruction}, *messages]
    content = messages[0]["content"]
    return [{**messages[0], "content": f"{content}\n\n{instruction}" if content else instruction}, *messages[1:]]


def _cache_hit(state: ServerState, req: ChatCompletionRequest, model: ServedModel, entry) -> Response:
    """A stored answer, as one body or replayed as SSE."""
    body = hit_body(entry, req.model, model.fingerprint)
    headers = {HEADER: "hit", REQUEST_ID_HEADER: body["id"]}
    state.metrics.outcomes.inc(outcome="cache_hit", model=model.name)
    log.info("request_finished", request_id=body["id"], outcome="cache_hit", model=req.model,
             prompt_tokens=body["usage"]["prompt_tokens"], completion_tokens=body["usage"]["completion_tokens"])
    if req.stream:
        return replayed(body, req.wants_usage(), state.settings.stream_timeout, headers)
    return json_response(body, headers=headers)


def _tool_format(settings, chat_template: str | None) -> ToolFormat | None:
    if settings.tool_call_parser != "auto":
        return FORMATS[settings.tool_call_parser]
    return detect(chat_template)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = validate(CompletionRequest, await json_body(request))
    if req.max_tokens == 0 and not req.echo:
        raise BadRequest("max_tokens: 0 is allowed only with echo", param="max_tokens")
    if req.echo and req.stream:
        raise BadRequest("echo: not supported with stream", param="echo")
    route = state.models.routes.get(req.model)
    if route is not None:
        prompts = req.prompts()
        if len(prompts) != 1:
            raise BadRequest(f"prompt: a request to {req.model!r} ({route.kind}) takes one prompt", param="prompt")
        text = prompts[0] if isinstance(prompts[0], str) else \
            state.models.get(route.large).engine.tokenizer.decode(prompts[0], skip_special_tokens=False)
        return await _decided(request, state, route, req, text, _completion_on)
    model, lora = state.models.resolve(req.model)
    return await _answer(request, state, await _completion_on(state, model, lora, req))


async def _completion_on(state: ServerState, model: ServedModel, lora: LoRARequest | None,
                         req: CompletionRequest) -> CompletionContext:
    tok = model.engine.tokenizer
    vocab = model.engine.vocab_size
    prompts = []
    for p in req.prompts():
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt must not be empty", param="prompt")
            prompts.append(tok.encode(p))
        else:
            check_token_ids(p, vocab, "prompt")
            prompts.append(list(p))
    echo = None
    if req.echo:  # the prompts as given (token ids: decoded)
        echo = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in req.prompts()]
    echo_only = echo is not None and req.max_tokens == 0
    shape = TextBody(tok, req.logprobs or 0, prompts, echo, echo_only)
    return await _serve(state, model, shape, req, prompts, req.max_tokens, req.logprobs, lora, echo=echo is not None,
                        echo_only=echo_only)


def _output_cap(model: ServedModel, req: SamplingFields, max_tokens: int | None) -> int | None:
    """The model's output cap on a request naming no max_tokens (its default_max_tokens, else its
    max_tokens_limit; None: the room left in its length); a max_tokens past the limit is a 400
    naming the field it came in."""
    limit = model.policy.max_tokens_limit
    if max_tokens is not None and limit is not None and max_tokens > limit:
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise BadRequest(f"{field}: {max_tokens} is more than the limit of {limit} for {model.name!r} "
                         "(--max-tokens-limit, or its models file entry)", param=field)
    return model.policy.default_max_tokens or limit


def _within(cap: int | None, room: int) -> int | None:
    """A cap the request did not ask for, shortened to the room its prompt leaves (None where
    there is none: _params refuses the prompt then)."""
    return None if cap is None or room < 1 else min(cap, room)


def _constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    try:
        return req.constraint()
    except GrammarError as e:
        raise BadRequest(f"{e.field}: {e}", param=e.field) from e


def _logit_bias(req: SamplingFields, vocab: int) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    bias = {int(t): b for t, b in req.logit_bias.items()}
    check_token_ids(bias, vocab, "logit_bias")
    return bias


def _params(req: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None,
            max_model_len: int, vocab: int, constraint: StructuredOutputsParams | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    room = max_model_len - prompt_len
    if room < 1:
        raise BadRequest(f"the prompt has {prompt_len} tokens; the model's length is {max_model_len}",
                         param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if max_tokens is not None and max_tokens > room:
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise BadRequest(f"{field}: {max_tokens} tokens after a prompt of {prompt_len} exceed the model's length "
                         f"({max_model_len})", param=field)
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, stop=req.stop, max_tokens=max_tokens or room, ignore_eos=req.ignore_eos,
            logprobs=logprobs, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
            stop_token_ids=_stop_token_ids(req, vocab), skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=_logit_bias(req, vocab),
            structured_outputs=constraint, prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
    except ValueError as e:
        raise BadRequest(str(e), param=_field_of(str(e))) from e


def _stop_token_ids(req: SamplingFields, vocab: int) -> list[int]:
    ids = req.stop_token_ids or []
    check_token_ids(ids, vocab, "stop_token_ids")
    return ids


def _field_of(message: str) -> str | None:
    """SamplingParams' messages start with the field they are about."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.isidentifier() else None


async def _serve(state: ServerState, model: ServedModel, shape: ChatBody | TextBody, req: SamplingFields,
                 prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, lora: LoRARequest | None,
                 tools_constraint: StructuredOutputsParams | None = None, tools_field: str | None = None,
                 echo: bool = False, echo_only: bool = False,
                 cache_plan: CachePlan | None = None, diet: Diet | None = None) -> CompletionContext:
    """Queues the request's engine requests; returns its context, which answers it.
    `tools_constraint`: the output the tools force (`tools_field` names where they are);
    `echo`: the prompts go before each completion (with logprobs: the prompts' logprobs too);
    `echo_only` (max_tokens 0): nothing generated is returned; `diet`: what the prompt budget
    removed from a chat's prompt (None: a chat under no budget, or a completion)."""
    engine = model.engine
    keep = req.truncate_prompt_tokens
    if keep is not None:
        if echo:
            raise BadRequest("truncate_prompt_tokens: not served with echo (the prompt echoed would not be the "
                             "prompt the model was given)", param="truncate_prompt_tokens")
        try:
            prompts = [truncate_prompt(p, keep, engine.max_model_len) for p in prompts]
        except ValueError as e:
            raise BadRequest(str(e), param="truncate_prompt_tokens") from e
    if isinstance(shape, TextBody) and (budget := _prompt_budget(model, req)) is not None:  # a chat's was fitted
        longest = max(len(p) for p in prompts)
        if longest > budget[0]:
            raise BadRequest(f"prompt: {longest} tokens, over the prompt budget of {budget[0]} (max_prompt_tokens; "
                             "truncate_prompt_tokens keeps a prompt's last tokens)", param="prompt")
    constraint, constraint_field = _constraint(req)
    if tools_constraint is not None:
        if constraint is not None:
            raise BadRequest(f"{constraint_field}: the tools already constrain the output (tool_choice "
                             "required or a named function, or a strict function under auto)",
                             param=constraint_field)
        constraint, constraint_field = tools_constraint, tools_field
    prompt_logprobs = logprobs if echo else None
    cap = _output_cap(model, req, max_tokens)
    engine_max = 1 if max_tokens == 0 else max_tokens  # echo of the prompt alone: one token, not returned
    params = [_params(req, len(p), engine_max or _within(cap, engine.max_model_len - len(p)), logprobs,
                      engine.max_model_len, engine.vocab_size, constraint, prompt_logprobs) for p in prompts]
    if state.draining:
        raise Unavailable("server is shutting down")
    try:
        engine.check_alive()
    except EngineDeadError as e:
        raise Unavailable(str(e)) from e
    limit = state.settings.max_waiting
    if limit is not None and engine.num_waiting() + len(prompts) * req.n > limit:
        raise TooManyRequests(f"the queue is full ({limit} waiting requests)")
    if lora is not None and model.loras.get(lora.lora_name) is not lora:
        # Unloaded while the request was being prepared (its template rendered): as if it came after.
        raise NotFound(f"model: the adapter {lora.lora_name!r} was unloaded", param="model", code="model_not_found")
    chat = isinstance(shape, ChatBody)
    base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    cache_status = on_done = None
    if cache_plan is not None:
        cache_status = "miss" if cache_plan.read else "bypass"
        on_done = lambda result: state.cache.save(cache_plan, result)  # noqa: E731
    ctx = CompletionContext(shape, base_id, req, prompts, state, model, time.perf_counter(), int(time.time()), lora,
                            echo_only=echo_only, cache_status=cache_status, on_done=on_done, diet=diet)
    streams = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            streams.append(await engine.add_request(f"{base_id}-{i}", prompt, p, lora_request=lora,
                                                    streaming=req.stream, max_pending=state.settings.max_stream_buffer,
                                                    priority=req.priority, cache_salt=req.cache_salt or ""))
    except GrammarError as e:
        ctx.abort(streams)
        ctx.ended_unstarted("refused")
        raise BadRequest(f"{constraint_field}: {e}", param=constraint_field) from e
    except ValueError as e:
        ctx.abort(streams)
        ctx.ended_unstarted("refused")
        field = getattr(e, "field", None)  # RequestRefused: the scheduler's field name
        prompt_param = "messages" if chat else "prompt"
        raise BadRequest(str(e), param=prompt_param if field == "prompt_token_ids" else field) from e
    except EngineDeadError as e:
        ctx.ended_unstarted("engine_dead")
        raise Unavailable(str(e)) from e
    except asyncio.CancelledError:
        ctx.ended_unstarted("cancelled")
        # NOTE: AsyncEngine.add_request only cleans up after a ValueError; a cancel while it waits
        # for the engine's answer would leave the prompt being added registered (and running).
        for i in range(len(streams) + 1):
            engine.abort_nowait(f"{base_id}-{i}")
        raise
    ctx.streams = streams
    return ctx
