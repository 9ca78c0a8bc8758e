"""The calculator agent of configs/tiny-agent.yaml on the OpenAI Agents SDK's Responses model
(``OpenAIResponsesModel``), unchanged: configs/tiny-agent-responses.yaml trains it (docs/environments.md §10.10).

:mod:`toy.tasks.calc_agent_sdk`'s agent with the model class swapped: the SDK's ``Runner`` talks to the
server's ``/v1/responses`` instead of its chat API, sending the whole conversation each turn (the server
keeps no responses). Nothing here knows tandem; the client the run hands in is the only link.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
)

from toy.tasks.calc_agent_sdk import ADD


async def agent(
    client: Any, record: dict[str, Any], *, model: str, max_turns: int = 3, max_tokens: int = 80
) -> dict[str, float]:
    calculator = Agent(
        name="calculator",
        tools=[ADD],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        # stop: an extension of the server's, as on its chat API; store: nothing is kept server-side
        model_settings=ModelSettings(max_tokens=max_tokens, store=False, extra_body={"stop": ["\n"]}),
    )
    try:
        # Tracing off: the SDK would otherwise send each run's trace to OpenAI's servers.
        result = await Runner.run(
            calculator, record["prompt"], max_turns=max_turns, run_config=RunConfig(tracing_disabled=True)
        )
    except MaxTurnsExceeded:  # still calling tools when the turns ran out: no answer, as the plain agent
        return {"correct": 0.0}
    except ModelBehaviorError:  # on Responses the SDK raises for a reply cut at max_output_tokens: no answer
        return {"correct": 0.0}
    return {"correct": float(str(result.final_output).strip() == str(record["result"]))}
