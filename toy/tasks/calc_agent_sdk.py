"""The calculator agent of configs/tiny-agent.yaml, written on the OpenAI Agents SDK (``openai-agents``),
unchanged: configs/tiny-agent-sdk.yaml trains it (docs/environments.md §10.9).

The task is :mod:`toy.tasks.calc_agent`'s: one ``add(a, b)`` tool and a reward of 1 for the right sum. The
loop is the SDK's own ``Runner``: it sends the chat request, runs each tool call the model makes and feeds
its result back, until the model answers without a call. Nothing here knows tandem; the client the run
hands in is the only link. The tool is declared with the plain agent's JSON schema, so the model sees the
prompt its warm start saw.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
)

from toy.tasks.calc_agent import TOOLS, run_tool

_ADD = TOOLS[0]["function"]


async def _add(_context: Any, arguments: str) -> str:
    return run_tool(_ADD["name"], arguments)


ADD = FunctionTool(
    name=_ADD["name"],
    description=_ADD["description"],
    params_json_schema=_ADD["parameters"],
    on_invoke_tool=_add,
    strict_json_schema=False,  # the schema as the plain agent sends it, so the prompt is the warm start's
)


async def agent(
    client: Any, record: dict[str, Any], *, model: str, max_turns: int = 3, max_tokens: int = 80
) -> dict[str, float]:
    calculator = Agent(
        name="calculator",
        tools=[ADD],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=max_tokens, extra_args={"stop": ["\n"]}),
    )
    try:
        # Tracing off: the SDK would otherwise send each run's trace to OpenAI's servers.
        result = await Runner.run(
            calculator, record["prompt"], max_turns=max_turns, run_config=RunConfig(tracing_disabled=True)
        )
    except MaxTurnsExceeded:  # still calling tools when the turns ran out: no answer, as the plain agent
        return {"correct": 0.0}
    return {"correct": float(str(result.final_output).strip() == str(record["result"]))}
