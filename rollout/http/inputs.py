"""What a request asks of the engine: its model, prompts and sampling parameters, checked against the
server's limits (docs/design.md §6.4).

``max_tokens`` is bounded by ``max_tokens_limit`` and the model's context; a request holds at most
``max_prompts_per_request`` prompts and asks for at most ``max_total_tokens_per_request`` tokens
(prompts × n × max_tokens). A forced tool call or a ``response_format`` becomes the reply's constraint
(:mod:`rollout.http.constraints`). Each failure is a 400 naming the field.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rollout.engines.base import SamplingParams
from rollout.engines.constraint import Constraint
from rollout.http.constraints import constraint_for
from rollout.http.schemas import APIError, ChatRequest, CompletionRequest, SamplingFields
from tandem.config import HTTPConfig


class EngineInputs:
    """Requests turned into the engine's inputs, for one model, tokenizer and context."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        http: HTTPConfig,
        *,
        names: set[str],
        max_context: int | None,
        adapters: tuple[str, ...] = (),
    ) -> None:
        """``names``: what ``model`` may say for the base model; ``adapters``: the served LoRA adapters'
        names, each generating with its adapter (rollout/engines/hf_lora.py)."""
        self.tokenizer, self.http = tokenizer, http
        self.max_context, self.adapters = max_context, adapters
        self.names = names | set(adapters)

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")

    def sampling(
        self, req: SamplingFields, max_tokens: int | None, prompts: list[list[int]]
    ) -> SamplingParams:
        longest = max(map(len, prompts))
        room = (self.max_context - longest) if self.max_context else self.http.max_tokens_limit
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {longest} tokens; this model's context is {self.max_context}",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(room, self.http.max_tokens_limit)
        if max_tokens > self.http.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens {max_tokens} exceeds the server's limit of {self.http.max_tokens_limit}",
                param="max_tokens",
            )
        if max_tokens > room:
            raise APIError(
                400,
                f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds this model's context of {self.max_context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # Every row holds its prompt's KV as well as its own tokens: the prompt counts n times.
        prompt_tokens = sum(map(len, prompts))
        total = (prompt_tokens + len(prompts) * max_tokens) * req.n
        if total > self.http.max_total_tokens_per_request:
            raise APIError(
                400,
                f"({prompt_tokens} prompt tokens + {len(prompts)} prompt(s) × max_tokens={max_tokens}) × "
                f"n={req.n} = {total} tokens exceeds the server's limit of "
                f"{self.http.max_total_tokens_per_request} per request (max_total_tokens_per_request)",
                param="max_tokens",
                code="request_too_large",
            )
        constraint = self.constraint(req)
        return SamplingParams(
            n=req.n,
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            # The grammar ends a constrained reply; a stop string meant for free text ("\n") would cut a
            # forced call's own markup or a JSON string into what the request did not ask for.
            stop=[] if constraint is not None else req.stop_list(),
            seed=req.seed,
            constraint=constraint,
            adapter=req.model if req.model in self.adapters else None,
        )

    def constraint(self, req: SamplingFields) -> Constraint | None:
        """What the reply must match: forced tool calls or ``response_format`` (rollout/http/constraints.py)."""
        if isinstance(req, ChatRequest):
            tools = [t.model_dump() for t in req.tools or []]
            return constraint_for(
                tools,
                req.tool_choice,
                req.response_format,
                self.http.tool_parser,
                parallel_tool_calls=req.parallel_tool_calls,
            )
        return constraint_for(None, None, req.response_format, None)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        else:
            prompts = p  # type: ignore[assignment]
        limit = self.http.max_prompts_per_request
        if not prompts or len(prompts) > limit:
            raise APIError(400, f"prompt must hold 1..{limit} prompts (got {len(prompts)})", param="prompt")
        out = [
            x if isinstance(x, list) else self.tokenizer(x, add_special_tokens=False).input_ids
            for x in prompts
        ]
        if not all(out):
            raise APIError(400, "a prompt is empty", param="prompt")
        return out
