"""The OpenAI layer: requests in, token chunks through the backend, OpenAI-shaped responses out.

It owns everything textual: tokenization and chat templates on the way in; incremental detokenization,
stop strings, logprob formatting and usage on the way out. Services only ever see token ids. Each request's
trace (tracing.py) is assembled here, from its arrival to its last token; with `request_trace` it is
returned as the response's `epdserve_trace` field (one entry per prompt; streamed: in the last chunk).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

from epdserve.services.proxy.choices import Choice, best_of, merge
from epdserve.services.proxy.generation import Backend, GenerateInput, GenerationError, ImageInput
from epdserve.services.proxy.lora_modules import LoRAModules
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.chat_tools import ChatAnswer
from epdserve.services.proxy.openai_protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from epdserve.services.proxy.output_constraints import ConstraintError, ConstraintLimits
from epdserve.services.proxy.prompt_logprobs import Echo, echo_logprobs, json_logprob, vllm_prompt_logprobs
from epdserve.services.proxy.reasoning_parsers import get_reasoning_parser
from epdserve.services.proxy.tracing import RequestTrace, Tracer
from epdserve.shared.processing.detokenizer import IncrementalDetokenizer
from epdserve.transport.channel.protocol import TokenLogprobs, WireLoRA
from epdserve.shared.engine import SamplingParams
from epdserve.shared.processing.mrope import mrope_positions
from epdserve.shared.processing.multimodal import MultiModalPlaceholder
from epdserve.shared.processing.tokenizer import Tokenizer


logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The client's request is invalid (HTTP 400, or `status`)."""

    def __init__(self, message: str, status: int = 400, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param = status, error_type, param


# Turns chat messages into (prompt token ids, images with placeholders) for multimodal models.
ChatEncoder = Callable[[list[dict], bool, dict], Awaitable["tuple[list[int], list[ImageInput]]"]]


class OpenAIServing:
    def __init__(self, model_name: str, tokenizer: Tokenizer, backend: Backend, max_model_len: int, vocab_size: int,
                 metrics: ProxyMetrics, chat_encoder: ChatEncoder | None = None,
                 response_timeout: float = 600.0, tool_call_parser: str = "hermes", tracer: Tracer | None = None,
                 request_trace: bool = False, constraint_limits: ConstraintLimits = ConstraintLimits(),
                 loras: LoRAModules | None = None, model_aliases: tuple[str, ...] = (),
                 max_images_per_prompt: int | None = None,
                 max_model_len_in_force: Callable[[], int | None] | None = None,
                 reasoning_parser: str | None = None) -> None:
        """`response_timeout`: seconds an HTTP request may wait for its answer (a stream's first event, or a
        whole non-streamed body) before it fails with 504. `tracer`: where each request's trace goes (default:
        the DEBUG log and the stage histogram); `request_trace`: also return it in the response.
        `model_aliases`: other names requests may give the model (responses name it `model_name`).
        `max_model_len_in_force`: the engines' context length (their --max-model-len), once they report it;
        until then, and without it, the model's `max_model_len`.
        `reasoning_parser`: how chat answers' reasoning is told from their content (None: it is not)."""
        self.model_name = model_name
        self.model_names = (model_name, *model_aliases)
        self.max_images_per_prompt = max_images_per_prompt
        self.vocab_size = vocab_size  # the model's, which may exceed the tokenizer's (padded embeddings)
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.backend = backend
        self._model_max_len = max_model_len
        self._max_model_len_in_force = max_model_len_in_force
        self.chat_encoder = chat_encoder
        self.response_timeout = response_timeout
        self.tool_call_parser = tool_call_parser  # reads calls out of the text when tool_choice is auto
        self.tracer = tracer or Tracer(observe_stage=metrics.observe_stage, model_name=model_name)
        self.request_trace = request_trace
        self.constraint_limits = constraint_limits  # how large a structured output or logit_bias may be
        self.loras = loras if loras is not None else LoRAModules(model_name)  # adapters offered as models
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)  # an unknown name fails here, not on the first request
        self.reasoning_parser = reasoning_parser

    @property
    def max_model_len(self) -> int:
        in_force = self._max_model_len_in_force() if self._max_model_len_in_force is not None else None
        return in_force or self._model_max_len

    # -- input --------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> WireLoRA | None:
        """The LoRA adapter `model` names (None: the base model, or no model given); 404 for any other name."""
        if model is None or model in self.model_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return lora

    def _answering(self, lora: WireLoRA | None) -> str:
        """The model a response names: the adapter asked for, else the base model."""
        return self.model_name if lora is None else lora.name

    async def encode_chat(self, request: ChatCompletionRequest) -> tuple[list[int], list[ImageInput]]:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        if request.tools:
            kwargs["tools"] = request.tools_for_template()
        limit = self.max_images_per_prompt
        if limit is not None:
            images = sum(part.get("type") == "image_url" for m in messages if isinstance(m.get("content"), list)
                         for part in m["content"])
            if images > limit:
                raise BadRequest(f"At most {limit} image(s) may be provided in one request; this one has {images} "
                                 "(the server's --limit-mm-per-prompt)", param="messages")
        if self.chat_encoder is not None:
            return await self.chat_encoder(messages, request.add_generation_prompt, kwargs)
        for m in messages:
            if isinstance(m.get("content"), list):
                if any(part["type"] != "text" for part in m["content"]):
                    raise BadRequest("this model takes text only: image_url content parts are not supported",
                                     param="messages")
                m["content"] = "".join(part.get("text") or "" for part in m["content"])
        try:  # off the event loop: a template over hundreds of tools, or a huge message, takes seconds
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages, request.add_generation_prompt,
                                           **kwargs), []
        except Exception as exc:  # a template error is the request's fault (roles out of order, ...)
            raise BadRequest(f"could not apply the chat template: {exc}") from None

    def _sampling(self, req: _SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                  prompt_param: str, max_tokens_param: str) -> SamplingParams:
        if prompt_len == 0:
            raise BadRequest("the prompt is empty", param=prompt_param)
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 0)
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {asked} tokens ({prompt_len} in the prompt, {max_tokens or 0} in the "
                             "completion). Please reduce the length of the prompt or completion.",
                             param=max_tokens_param if room > 0 else prompt_param)
        max_tokens = room if max_tokens is None else max_tokens
        if req.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                             param="min_tokens")
        if req.top_k is not None and req.top_k not in (-1, 0) and not 1 <= req.top_k <= self.vocab_size:
            raise BadRequest(f"top_k must be -1 or 0 (off) or in [1, {self.vocab_size}], got {req.top_k}",
                             param="top_k")
        if any(not 0 <= t < self.vocab_size for t in req.stop_token_ids or ()):
            raise BadRequest(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        try:
            params = req.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return self._constrained(req, params)

    def _constrained(self, req: _SamplingFields, params: SamplingParams) -> SamplingParams:
        """`params` with the request's logit_bias and output constraint (a forced tool call's included)."""
        try:
            constraint, field = req.output_constraint(self.constraint_limits)
            forced_call = req.tool_call_constraint(self.constraint_limits) \
                if isinstance(req, ChatCompletionRequest) else None
            biases = req.token_biases(self.vocab_size, self.constraint_limits)
        except ConstraintError as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        if forced_call is not None:
            if constraint is not None:
                raise BadRequest(f"{field} cannot be combined with a forced tool_choice", param=field)
            constraint = forced_call
        return replace(params, logit_bias=biases, structured_outputs=constraint)

    def _chat_answer(self, req: ChatCompletionRequest, constrained: bool) -> ChatAnswer:
        """One choice's answer builder; `constrained`: the output follows a structured-output constraint (a
        forced tool call's included) from its first token."""
        mode = req.tool_mode()
        reasoning = None
        if self.reasoning_parser is not None:
            thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
            reasoning = get_reasoning_parser(self.reasoning_parser, thinking if isinstance(thinking, bool) else None,
                                             constrained)
        return ChatAnswer(mode, self.tool_call_parser, req.tool_choice.function.name if mode == "named" else None,
                          req.parallel_tool_calls, reasoning, req.include_reasoning)

    @staticmethod
    def log_unknown_fields(req: _SamplingFields, request_id: str) -> None:
        if req.unknown_fields:
            logger.warning("request %s: ignoring fields outside the API: %s", request_id,
                           ", ".join(req.unknown_fields))

    @staticmethod
    def with_prompt_logprobs(sampling: SamplingParams, *wanted: int | None) -> SamplingParams:
        """`sampling` asking the engine for the most prompt logprobs any of `wanted` asks for (None: none)."""
        asked = [n for n in wanted if n is not None]
        return replace(sampling, prompt_logprobs=max(asked)) if asked else sampling

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequest(f"token ids must be in [0, {self.vocab_size})", param=param)

    # -- running ------------------------------------------------------------------------------------
    async def _run(self, gen: GenerateInput, sampling: SamplingParams, trace: RequestTrace,
                   first_index: int = 0) -> AsyncIterator[Choice]:
        """Yield a sequence's result after each chunk of it (n > 1: the n sequences' interleave; choice index
        `first_index` + the sequence's); stops the backend stream once every sequence has finished, a stop
        string included (with n > 1 the engine runs a sequence a stop string ended here to its own end).
        The chunks' spans go into `trace`, which is closed (logged, exported) when the request ends."""
        results = [Choice(IncrementalDetokenizer(self.tokenizer.fast, sampling.stop,
                                                  sampling.include_stop_str_in_output, sampling.skip_special_tokens),
                           sampling, first_index + i) for i in range(sampling.n)]
        m = self.metrics
        start = last = time.monotonic()
        ttft = None
        trace_error: str | None = "ended before its last token (the client went away)"
        m.in_flight.inc()
        stream = self.backend.generate(gen)
        try:
            async for chunk in stream:
                if chunk.trace:
                    trace.add(chunk.trace)
                result = results[chunk.index]
                if result.finished:
                    continue
                now = time.monotonic()
                if ttft is None:
                    ttft = now - start
                    m.ttft.observe(ttft)
                    trace.add_own("proxy.first_token", trace.start)
                elif chunk.token_ids:
                    for _ in chunk.token_ids:
                        m.itl.observe((now - last) / len(chunk.token_ids))
                last = now
                result.add(chunk)
                if chunk.prompt_logprobs:  # the prompt's, scored once for all its sequences
                    for other in results:
                        other.prompt_logprobs = chunk.prompt_logprobs
                yield result
                if all(r.finished for r in results):
                    break
            trace_error = None if all(r.finished for r in results) else "ended without a finish reason"
        except GenerationError as exc:
            trace_error = str(exc)
            m.failed(exc.status)
            raise
        finally:
            m.in_flight.dec()
            await stream.aclose()  # aborts the request on the services if it did not finish there
            self.tracer.close(trace, trace_error)
        if not all(r.finished for r in results):
            m.failed(502)
            raise GenerationError("the request ended without a finish reason", 502, "BadGatewayError")
        m.finished(results[0].finish_reason, len(gen.prompt_token_ids), max(r.num_cached_tokens for r in results),
                   sum(len(r.token_ids) for r in results), sampling, time.monotonic() - start, ttft,
                   max(len(r.token_ids) for r in results))

    async def _run_all(self, gens: list[GenerateInput], samplings: list[SamplingParams],
                       traces: list[RequestTrace]) -> AsyncIterator[Choice]:
        """`_run` for each prompt's request, side by side: choice indices prompt_index * n + i."""
        streams = [self._run(gen, sampling, trace, i * sampling.n)
                   for i, (gen, sampling, trace) in enumerate(zip(gens, samplings, traces))]
        async for result in merge(streams):
            yield result

    @staticmethod
    async def _finals(results: AsyncIterator[Choice]) -> list[Choice]:
        """Every choice's final result, by index."""
        finals = {}
        async for result in results:
            finals[result.index] = result
        return [finals[i] for i in sorted(finals)]

    def _input(self, request_id: str, ids: list[int], sampling: SamplingParams, images: list[ImageInput],
               salt: str | None, lora: WireLoRA | None = None) -> GenerateInput:
        # Stop strings stay here: the engine gets token-level stops only.
        engine_params = replace(sampling, stop=[], include_stop_str_in_output=False)
        positions = None
        if images and images[0].grid is not None:  # an M-RoPE model's: positions follow from the image grids
            placeholders = [MultiModalPlaceholder(i.offset, i.length, i.mm_hash) for i in images]
            positions = mrope_positions(len(ids), placeholders, [i.grid for i in images])
        return GenerateInput(request_id, ids, engine_params, images, salt, positions, lora)

    # -- /v1/completions ----------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request_id: str) -> dict | AsyncIterator[str]:
        arrived = time.time()
        lora = self.check_model(req.model)
        self.log_unknown_fields(req, request_id)
        # Tokenizing and checking the constraints take seconds for a huge body: off the event loop.
        gens, samplings, echoes = await asyncio.to_thread(self._completion_inputs, req, request_id, lora)
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self._answering(lora)}
        as_ids = req.return_tokens_as_token_ids
        traces = [self.tracer.new(gen.request_id, arrived) for gen in gens]
        if req.stream:
            return self._stream_completion(gens, samplings, head, echoes, req.include_usage, as_ids, traces)
        results = await self._finals(self._run_all(gens, samplings, traces))
        returned = results
        if req.best_of is not None:
            per_prompt = gens[0].params.n
            returned = [r for i in range(len(gens))
                        for r in best_of(results[i * per_prompt:(i + 1) * per_prompt], req.n,
                                         lambda r: r.cumulative_logprob)]
        choices = []
        for index, result in enumerate(returned):
            prompt_index = result.index // gens[0].params.n
            echo, ids = echoes[prompt_index], gens[prompt_index].prompt_token_ids
            text, tokens, logprobs = ("", [], []) if echo and echo.only else result.take_delta()
            offset = len(echo.text) if echo else 0
            lp = self._completion_logprobs(tokens, logprobs, offset, as_ids) if req.logprobs is not None else None
            if lp is not None and echo:
                lp = {key: value + lp[key] for key, value in self._echo_logprobs(echo, result, as_ids).items()}
            choice = {"index": index, "text": (echo.text if echo else "") + text, "logprobs": lp,
                      **self._finish(result, echo)}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(ids, result.prompt_logprobs, self._token_text)
            choices.append(choice)
        return head | {"choices": choices, "usage": self._usage(gens, results, echoes[0])} | self._trace_field(traces)

    def _completion_inputs(self, req: CompletionRequest, request_id: str, lora: WireLoRA | None = None
                           ) -> tuple[list[GenerateInput], list[SamplingParams], list[Echo | None]]:
        """Each prompt's request (tokenized, its sampling checked), sampling and echo; raises BadRequest."""
        try:
            prompts = req.prompts()
        except ValueError as exc:
            raise BadRequest(str(exc), param="prompt") from None
        gens, samplings, echoes = [], [], []
        for prompt in prompts:  # each prompt is a request of its own, routed on its own
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
                self.check_token_ids(ids, "prompt")
                prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
            # max_tokens 0 (echo only) still runs the prompt, for its logprobs: one token, not answered.
            sampling = self._sampling(req, len(ids), 1 if req.max_tokens == 0 else req.max_tokens, req.logprobs,
                                      "prompt", "max_tokens")
            sampling = self.with_prompt_logprobs(sampling, req.prompt_logprobs, req.logprobs if req.echo else None)
            if req.best_of is not None:  # ranked by cumulative logprob: every token's is needed
                sampling = replace(sampling, n=req.best_of, logprobs=sampling.logprobs or 0)
            gens.append(self._input(_internal_id(request_id), ids, sampling, [], req.cache_salt, lora))
            samplings.append(sampling)
            echoes.append(Echo(prompt, ids, req.max_tokens == 0) if req.echo else None)
        return gens, samplings, echoes

    def _echo_logprobs(self, echo: Echo, result: Choice, as_ids: bool) -> dict:
        return echo_logprobs(echo, result.prompt_logprobs, lambda t: self._token_label(t, as_ids), self._token_text)

    @staticmethod
    def _finish(result: Choice, echo: Echo | None) -> dict:
        if echo and echo.only:
            return {"finish_reason": "length", "stop_reason": None}
        return {"finish_reason": result.finish_reason, "stop_reason": result.stop_reason}

    async def _stream_completion(self, gens, samplings, head, echoes, include_usage, as_ids,
                                 traces) -> AsyncIterator[str]:
        n = gens[0].params.n
        offsets: dict[int, int] = {}  # choice index -> text sent so far (its echo included)
        finals: dict[int, Choice] = {}
        echo_only = bool(echoes[0] and echoes[0].only)  # then the last chunks come after the loop
        ended: set[int] = set()  # choices whose last chunk is out (their results change on, meanwhile)
        async for result in self._run_all(gens, samplings, traces):
            index, echo = result.index, echoes[result.index // n]
            finals[index] = result
            if index not in offsets:  # the prompt's logprobs come with the first token
                offsets[index] = 0
                if echo:
                    lp = self._echo_logprobs(echo, result, as_ids) if result.params.logprobs is not None else None
                    yield _sse(head | {"choices": [{"index": index, "text": echo.text, "logprobs": lp,
                                                    "finish_reason": None}]})
                    offsets[index] = len(echo.text)
            if echo and echo.only:
                continue  # its one token is no answer; the loop ends after it
            text, tokens, logprobs = result.take_delta()
            if not text and not tokens and not result.finished:
                continue
            lp = self._completion_logprobs(tokens, logprobs, offsets[index], as_ids) \
                if result.params.logprobs is not None else None
            offsets[index] += len(text)
            if result.finished:
                ended.add(index)
            last = not include_usage and not echo_only and len(ended) == len(gens) * n
            yield _sse(head | {"choices": [{"index": index, "text": text, "logprobs": lp,
                                            "finish_reason": result.finish_reason,
                                            "stop_reason": result.stop_reason}]}
                       | (self._trace_field(traces) if last else {}))
        for index, result in sorted(finals.items()):
            echo = echoes[index // n]
            if echo and echo.only:
                last = not include_usage and index == max(finals)
                yield _sse(head | {"choices": [{"index": index, "text": "", "logprobs": None,
                                                **self._finish(result, echo)}]}
                           | (self._trace_field(traces) if last else {}))
        if include_usage:
            yield _sse(head | {"choices": [], "usage": self._usage(gens, list(finals.values()), echoes[0])}
                       | self._trace_field(traces))
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, tokens: list[int], logprobs: list[TokenLogprobs], offset: int,
                             as_ids: bool) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(tokens, logprobs):
            text = self._token_text(token)
            out["tokens"].append(self._token_label(token, as_ids))
            out["token_logprobs"].append(json_logprob(lp.logprob))
            out["top_logprobs"].append({self._token_label(t, as_ids): json_logprob(v) for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # -- /v1/chat/completions -----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request_id: str) -> dict | AsyncIterator[str]:
        arrived = time.time()
        lora = self.check_model(req.model)
        self.log_unknown_fields(req, request_id)
        ids, images = await self.encode_chat(req)
        # A JSON schema is checked against its metaschema here: seconds for a huge one, off the event loop.
        sampling = await asyncio.to_thread(self._sampling, req, len(ids), req.effective_max_tokens, req.num_logprobs,
                                           "messages", req.max_tokens_field)
        sampling = self.with_prompt_logprobs(sampling, req.prompt_logprobs)
        gen = self._input(_internal_id(request_id), ids, sampling, images, req.cache_salt, lora)
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self._answering(lora)}
        trace = self.tracer.new(gen.request_id, arrived)
        constrained = sampling.structured_outputs is not None
        if req.stream:
            return self._stream_chat(gen, sampling, head | {"object": "chat.completion.chunk"}, req.include_usage,
                                     req.return_tokens_as_token_ids, lambda: self._chat_answer(req, constrained),
                                     trace)
        results = await self._finals(self._run(gen, sampling, trace))
        choices = []
        for result in results:
            text, tokens, logprobs = result.take_delta()
            message, finish_reason = self._chat_answer(req, constrained).message(text, result.finish_reason)
            choices.append({"index": result.index, "message": message,
                            "logprobs": {"content": self._chat_logprobs(tokens, logprobs,
                                                                        req.return_tokens_as_token_ids)}
                            if sampling.logprobs is not None else None,
                            "finish_reason": finish_reason, "stop_reason": result.stop_reason})
        body = head | {"choices": choices, "usage": self._usage([gen], results)}
        if req.prompt_logprobs is not None:  # vLLM's extension, beside the choices as there
            body["prompt_logprobs"] = vllm_prompt_logprobs(ids, results[0].prompt_logprobs, self._token_text)
        return body | self._trace_field([trace])

    async def _stream_chat(self, gen, sampling, head, include_usage, as_ids,
                           new_answer: Callable[[], ChatAnswer], trace: RequestTrace) -> AsyncIterator[str]:
        finals: dict[int, Choice] = {}
        texts: dict[int, tuple[str, ChatAnswer]] = {}  # choice index -> (its text so far, its answer parser)
        ended: set[int] = set()  # choices whose last chunk is out
        async for result in self._run(gen, sampling, trace):
            index = result.index
            finals[index] = result
            if result.sent_tokens == 0:  # announce the role once the request is known to run
                yield _sse(head | {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            text, tokens, logprobs = result.take_delta()
            if not text and not tokens and not result.finished:
                continue
            lp = {"content": self._chat_logprobs(tokens, logprobs, as_ids)} if sampling.logprobs is not None else None
            full_text, answer = texts.get(index) or ("", new_answer())
            full_text += text
            texts[index] = (full_text, answer)
            delta = answer.delta(full_text, result.finished)
            if not delta and not tokens and not result.finished:
                continue  # text held back (a tool call being parsed) and nothing else to say
            if result.finished:
                ended.add(index)
            last = not include_usage and len(ended) == sampling.n
            yield _sse(head | {"choices": [{"index": index, "delta": delta,
                                            "logprobs": lp, "finish_reason": answer.finish_reason(result.finish_reason),
                                            "stop_reason": result.stop_reason}]}
                       | (self._trace_field([trace]) if last else {}))
        if include_usage:
            yield _sse(head | {"choices": [], "usage": self._usage([gen], list(finals.values()))}
                       | self._trace_field([trace]))
        yield "data: [DONE]\n\n"

    def _chat_logprobs(self, tokens: list[int], logprobs: list[TokenLogprobs], as_ids: bool) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": self._token_label(token_id, as_ids), "logprob": json_logprob(logprob),
                    "bytes": list(text.encode())}

        return [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                for t, lp in zip(tokens, logprobs)]

    # -- shared -------------------------------------------------------------------------------------
    def _trace_field(self, traces: list[RequestTrace]) -> dict:
        """`epdserve_trace` (with request_trace): each prompt's trace, ended now if it is not yet (the last
        chunk of a stream leaves before its request's end is recorded)."""
        if not self.request_trace:
            return {}
        for trace in traces:
            trace.finish()
        return {"epdserve_trace": [trace.breakdown() for trace in traces]}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.fast.decode([token_id], skip_special_tokens=False)

    def _token_label(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id else self._token_text(token_id)

    @staticmethod
    def _usage(gens: list[GenerateInput], results: list[Choice], echo: Echo | None = None) -> dict:
        """Each prompt counted once, every generated sequence's tokens (best_of's unreturned ones too)."""
        prompt = sum(len(gen.prompt_token_ids) for gen in gens)
        completion = 0 if echo and echo.only else sum(len(r.token_ids) for r in results)
        cached: dict[int, int] = {}  # per prompt: its sequences share one prefill
        for r in results:
            key = r.index // gens[0].params.n
            cached[key] = max(cached.get(key, 0), r.num_cached_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _internal_id(request_id: str) -> str:
    """The id services know the request by: the client's (for tracing across logs) plus a random part,
    so two clients sending the same X-Request-Id can never touch each other's request."""
    return f"{request_id}.{uuid.uuid4().hex[:12]}"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
