"""Request schemas of the HTTP API, the text validators every request passes, and OpenAI's error shape.

Every request body is checked before its fields (docs/design.md §6.4): a string anywhere in it, known field
or not, nested or not, that holds a lone surrogate or NUL gets 400 naming the field. Fields are strict:
``"5"`` is not a number and ``true`` is not an integer. Every failure is answered as
``{"error": {"message", "type", "param", "code"}}`` (:class:`APIError`, :func:`error_response`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rollout.http import limits

MAX_N = 64  # choices per prompt
GREEDY_BELOW = 1e-5  # a lower temperature samples greedily (vLLM's _SAMPLING_EPS)
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters of one stop string
MAX_LOGIT_BIAS = 1024  # logit_bias entries


def text_problem(s: str) -> str | None:
    """Why ``s`` is not text a request may carry, or None.

    JSON can spell a lone surrogate (``"\\ud800"``), and Python's decoder lets UTF-8-encoded surrogates
    through too; such a string cannot be encoded, so the tokenizer (or any reply echoing it) would fail.
    NUL is refused as well: C-level consumers of prompts and logs treat it as the end of the string.
    """
    if (nul := s.find("\x00")) >= 0:
        return f"contains a NUL character (\\u0000) at position {nul}"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"contains a lone surrogate (\\u{ord(s[e.start]):04x}) at position {e.start}"
    return None


def _first_bad_text(data: Any) -> tuple[str, str] | None:
    """``(param, problem)`` of the first string in a parsed JSON body (values and keys, in document order)
    that :func:`text_problem` refuses, or of the first value nested past :data:`limits.MAX_JSON_DEPTH`.
    Iterative: a deeply nested body must not exhaust the stack."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if problem := text_problem(value):
                return ".".join(path), problem
        elif isinstance(value, (dict, list)) and len(path) >= limits.MAX_JSON_DEPTH:
            return ".".join(path[:3]), limits.too_deep(len(path) + limits.value_depth(value))
        elif isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (problem := text_problem(key)):
                    return ".".join(path), f"a key {problem}"
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*path, str(i)), v) for i, v in reversed(list(enumerate(value))))
    return None


class _Request(BaseModel):
    """A request body. Every string in it, known field or not, must be valid Unicode text without NUL:
    checked on the raw body before the fields, so the error names the field (docs/design.md §6.4)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if (bad := _first_bad_text(data)) is not None:
            param, problem = bad
            raise PydanticCustomError("invalid_text", "{problem}", {"param": param, "problem": problem})
        return data


class SamplingFields(_Request):
    """Fields both endpoints share. Strict: ``"5"`` is not a number and ``true`` is not an integer.

    Sampling parameters are bounded as vLLM bounds them (docs/design.md §6.4): every number finite (Python's
    JSON reader takes ``NaN`` and ``Infinity``), a temperature below :data:`GREEDY_BELOW` is greedy (dividing
    logits by 1e-300 gives inf and NaN), penalties in vLLM's ranges. The penalties and ``logit_bias`` are
    validated and accepted for compatibility; the hf engine does not apply them.
    """

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # an extension, as in vLLM and SGLang
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # an extension, as in vLLM
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what torch.Generator.manual_seed takes
    stream: bool = False
    session_id: str | None = Field(None, min_length=1, max_length=128)  # or the X-Session-Id header
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by rollout/http/constraints.py
    response_format: dict[str, Any] | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_below_eps(cls, v: float) -> float:
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise PydanticCustomError(
                    "logit_bias", "keys must be token ids (got {token!r})", {"token": token}
                )
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise PydanticCustomError(
                    "logit_bias",
                    "token {token}: bias must be a finite number in [-100, 100] (got {bias})",
                    {"token": token, "bias": bias},
                )
        return v

    @field_validator("stop")
    @classmethod
    def _stop_length(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > MAX_STOP_CHARS:
                raise PydanticCustomError(
                    "stop",
                    "a stop string has {n} characters; the limit is {limit}",
                    {"n": len(s), "limit": MAX_STOP_CHARS},
                )
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)


class FunctionCall(BaseModel):
    """A call the assistant made, as a client echoes it back: ``arguments`` is JSON text, as OpenAI sends it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message of the conversation. ``content`` may be null only on an assistant message that holds
    ``tool_calls`` (checked by the app, which names the message)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p["text"] for p in self.content if p.get("type") == "text" and isinstance(p.get("text"), str)
        )


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, passed to the chat template as it is
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False  # a last chunk, with no choices, carries the request's usage


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; checked below and,
    # against ``tools``, by the app
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if (
            isinstance(v, dict)
            and v.get("type") == "function"
            and isinstance(v.get("function"), dict)
            and isinstance(v["function"].get("name"), str)
        ):
            return v
        raise PydanticCustomError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )

    def tool_choice_name(self) -> str | None:
        """The function a named ``tool_choice`` asks for, or None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


class FinishRequest(_Request):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(allow_inf_nan=False)
    group_id: str | None = Field(None, min_length=1, max_length=128)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status
    )


ANTHROPIC_PATH = "/v1/messages"  # its errors answer in Anthropic's shape (rollout/http/messages_api.py)
# Anthropic's error type for each status (docs.anthropic.com/en/api/errors); any other status is api_error
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
