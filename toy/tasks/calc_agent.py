"""A function-calling calculator agent on the plain ``openai`` SDK (configs/tiny-agent.yaml, docs/environments.md §10.9).

It knows nothing of the server it runs against: any OpenAI-compatible endpoint that does function calling
serves it. Asked ``"37+48="``, it offers one tool, ``add(a, b)``; each tool call the model makes is run here
and answered as a ``tool`` message; the first reply without a tool call is the answer. The reward is 1 when
the answer is the sum. A malformed call comes back from the server as plain content, so it is taken as the
answer (and is wrong): the model is rewarded only for calls it writes well.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client comes from the caller; the SDK is needed only to make one
    import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> str:
    return str(int(a) + int(b))


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer, or an error the model can read (a tool failure is the agent's business)."""
    if name != "add":
        return f"error: no tool {name}"
    try:
        return add(**json.loads(arguments))
    except (ValueError, TypeError) as e:
        return f"error: {e}"


async def agent(
    client: openai.AsyncOpenAI,
    record: dict[str, Any],
    *,
    model: str,
    max_turns: int = 3,
    max_tokens: int = 80,
    tool_bonus: float = 0.0,
    first_tool_choice: str = "auto",
) -> dict[str, float]:
    """``tool_bonus``: a reward part ``tool`` for an episode that called the tool (0: none, no part).
    ``first_tool_choice``: the first turn's ``tool_choice``; ``"required"`` makes every episode call the tool
    at least once, so every episode has two turns or more (the chaos test's agent sessions)."""

    def parts(correct: bool, called: bool) -> dict[str, float]:
        return {"correct": float(correct), **({"tool": tool_bonus * called} if tool_bonus else {})}

    messages: list[dict[str, Any]] = [{"role": "user", "content": record["prompt"]}]
    for turn in range(max_turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, stop=["\n"],
            tool_choice=first_tool_choice if turn == 0 else "auto",
        )  # fmt: skip
        message = response.choices[0].message
        if not message.tool_calls:
            # a thinking model's reasoning before the answer is not the answer (tiny-agent-think.yaml)
            answer = (message.content or "").split("</think>")[-1].strip()
            return parts(answer == str(record["result"]), called=turn > 0)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return parts(False, called=True)
