"""The calculator agent of configs/tiny-agent.yaml, written on the ``anthropic`` SDK's Messages API
(configs/tiny-agent-anthropic.yaml, docs/environments.md §10.10).

The task is :mod:`toy.tasks.calc_agent`'s: one ``add(a, b)`` tool and a reward of 1 for the right sum. Each
``tool_use`` block the model writes is run here and answered with a ``tool_result`` block; the first reply
without one is the answer. Nothing here knows tandem: any server of the Messages API that does tool use
serves it. The run hands an agent an OpenAI client on a session of its API; the Anthropic client is made
from its address, key and session header.
"""

from __future__ import annotations

from typing import Any

import anthropic

from toy.tasks.calc_agent import TOOLS, add

_ADD = TOOLS[0]["function"]
ADD = {"name": _ADD["name"], "description": _ADD["description"], "input_schema": _ADD["parameters"]}


def anthropic_client(client: Any) -> anthropic.AsyncAnthropic:
    """An Anthropic client on the server and session of the OpenAI client ``client``."""
    base_url = str(client.base_url).rstrip("/").removesuffix("/v1")
    session = {k: v for k, v in client.default_headers.items() if k.lower() == "x-session-id"}
    return anthropic.AsyncAnthropic(
        base_url=base_url, api_key=client.api_key, default_headers=session, max_retries=0
    )


def run_tool(block: Any) -> str:
    """The tool's answer, or an error the model can read (a tool failure is the agent's business)."""
    if block.name != "add":
        return f"error: no tool {block.name}"
    try:
        return add(**block.input)
    except (ValueError, TypeError) as e:
        return f"error: {e}"


async def agent(
    client: Any, record: dict[str, Any], *, model: str, max_turns: int = 3, max_tokens: int = 80
) -> dict[str, float]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": record["prompt"]}]
    async with anthropic_client(client) as claude:
        for _ in range(max_turns):
            reply = await claude.messages.create(
                model=model, max_tokens=max_tokens, messages=messages, tools=[ADD], stop_sequences=["\n"]
            )
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                answer = "".join(b.text for b in reply.content if b.type == "text").strip()
                return {"correct": float(answer == str(record["result"]))}
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
            )
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b)} for b in calls]
            messages.append({"role": "user", "content": results})
    return {"correct": 0.0}
