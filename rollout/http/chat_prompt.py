"""Chat requests rendered to prompts through the tokenizer's chat template, tools included (docs/environments.md §10.8).

A request without tools or tool calls renders its messages as ``{"role", "content"}`` only. With them, the
template gets OpenAI's tools (``apply_chat_template(messages, tools=...)``), assistant messages with their
``tool_calls`` (arguments as objects, as templates expect) and tool messages with their ``tool_call_id``,
when the template renders tools and tool calls; one that ignores them (told apart by rendering a probe
once) gets the Hermes-style messages of :func:`rollout.http.tools.hermes_messages` instead.

In an agent session (docs/environments.md §10.6) an assistant message whose calls the session returned is
rendered as the text the model sampled (``replay``), so the prompt extends the session's transcript
exactly rather than re-serialising the calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from rollout.http import limits
from rollout.http.images import template_content
from rollout.http.schemas import APIError, ChatMessage, ChatRequest
from rollout.http.tools import hermes_messages
from tandem.data import chat_token_ids

_PROBE = "tandem_probe_function"


class ChatPrompts:
    """Prompts of chat requests for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._native: bool | None = None

    def token_ids(self, req: ChatRequest) -> list[int]:
        messages, tools = self.messages(req)
        if tools is None:
            return chat_token_ids(self.tokenizer, messages)
        encoded = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(t) for t in encoded["input_ids"]]

    def text(self, req: ChatRequest, replay: Mapping[str, str] | None = None) -> str:
        messages, tools = self.messages(req, replay)
        kwargs = {} if tools is None else {"tools": tools}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )

    def messages(
        self, req: ChatRequest, replay: Mapping[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """``(messages, tools)`` for the template; ``tools`` is None where the template is not to get them."""
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [_template_message(i, m, replay or {}) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools is None and not any("tool_calls" in m for m in messages):
            return [{"role": m["role"], "content": m["content"]} for m in messages], None
        if self.native:
            return messages, tools
        return hermes_messages(messages, tools), None

    @property
    def native(self) -> bool:
        """Whether the chat template renders both tools and an assistant's tool calls (probed once)."""
        if self._native is None:
            tool = {"type": "function", "function": {"name": _PROBE, "parameters": {"type": "object"}}}
            call = {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
            user = {"role": "user", "content": "hi"}
            try:
                with_tools = self.tokenizer.apply_chat_template(
                    [user], tools=[tool], add_generation_prompt=True, tokenize=False
                )
                with_call = self.tokenizer.apply_chat_template(
                    [user, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
                )
            except Exception:  # a template that refuses the probe cannot be relied on for tools either
                self._native = False
            else:
                self._native = _PROBE in with_tools and _PROBE in with_call
        return self._native


def _template_message(i: int, m: ChatMessage, replay: Mapping[str, str]) -> dict[str, Any]:
    """One message in the form chat templates take; a message the template cannot take gets 400."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise APIError(
            400,
            f"messages.{i}.content: only an assistant message with tool_calls may omit content",
            param=f"messages.{i}.content",
        )
    if m.role != "assistant" and m.tool_calls:
        raise APIError(
            400,
            f"messages.{i}.tool_calls: only an assistant message makes tool calls",
            param=f"messages.{i}.tool_calls",
        )
    out: dict[str, Any] = {"role": m.role, "content": template_content(m)}
    if m.tool_calls:
        ids = [c.id for c in m.tool_calls]
        if ids[0] in replay and all(replay.get(x) == replay[ids[0]] for x in ids):
            return {"role": "assistant", "content": replay[ids[0]]}  # the sampled text, exactly
        out["tool_calls"] = []
        for j, c in enumerate(m.tool_calls):
            param = f"messages.{i}.tool_calls.{j}.function.arguments"
            try:
                arguments = limits.loads(c.function.arguments)
            except limits.JSONLimitError as e:
                raise APIError(400, f"{param}: {e}", param=param, code="json_limit_exceeded") from None
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{param}: must be a JSON object", param=param)
            function = {"name": c.function.name, "arguments": arguments}
            out["tool_calls"].append({"id": c.id, "type": "function", "function": function})
    if m.role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out
