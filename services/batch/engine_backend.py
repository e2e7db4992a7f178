"""An engine in this process as the OpenAI layer's Backend: `epdserve run-batch` without a deployment.

The same contract the services keep (see `services.proxy.generation`): token ids and wire logprobs in
chunks, the first chunk with the prompt's cached-token count and prompt logprobs; leaving the stream early
aborts the request in the engine.
"""
from __future__ import annotations

from dataclasses import replace
from typing import AsyncIterator

from epdserve.services.proxy.generation import Chunk, GenerateInput, GenerationError
from epdserve.shared.engine import AsyncLLM, EngineDeadError, RequestFailedError, RequestOutputKind
from epdserve.services.host.wire import logprobs_to_wire, prompt_logprobs_to_wire


class EngineBackend:
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    async def generate(self, gen: GenerateInput) -> AsyncIterator[Chunk]:
        if gen.images:
            raise GenerationError("image inputs need an encoder, which a local engine does not run", 400,
                                  "BadRequestError")
        params = replace(gen.params, output_kind=RequestOutputKind.DELTA)
        try:
            request = await self.llm.make_request({"prompt_token_ids": list(gen.prompt_token_ids)}, params, gen.request_id,
                                            cache_salt=gen.cache_salt)
        except ValueError as exc:
            raise GenerationError(str(exc), 400, "BadRequestError") from None
        first = True
        try:
            async for out in self.llm.generate(request):
                completion = out.outputs[0]
                if completion.finish_reason == "error":
                    raise GenerationError(f"the request failed in the engine: {out.error}", 500)
                yield Chunk(list(completion.token_ids), list(logprobs_to_wire(out, params.logprobs)),
                            completion.finish_reason, completion.stop_reason,
                            out.num_cached_tokens if first else None,
                            list(prompt_logprobs_to_wire(out, params.prompt_logprobs)) or None,
                            index=completion.index)
                first = False
        except ValueError as exc:  # the request's own doing
            raise GenerationError(str(exc), 400, "BadRequestError") from None
        except (RequestFailedError, EngineDeadError) as exc:
            raise GenerationError(str(exc), 500) from None
