"""The calculator task for a function-calling agent (configs/tiny-agent.yaml, docs/environments.md §10.9).

Prompts are two-digit additions, ``"37+48="``, answered by :mod:`toy.tasks.calc_agent` with its ``add``
tool. The records carry the sum (``result``). The warm-start's demonstrations are whole sessions as the
byte-level tiny model's chat template renders them (``toy.tiny.TOOLS_CHAT_TEMPLATE``): the prompt with
the tools line, then either a Hermes tool call, its result and the copied answer, or (half of them) a
direct guess, usually wrong, so the warm policy calls the tool only sometimes and RL has a rate to raise.
"""

from __future__ import annotations

import json
import random
from typing import Any

from toy.tasks.calc_agent import TOOLS


def chat_prompt(question: str) -> str:
    """The first prompt of a session, as the tools template renders it with the generation prompt."""
    names = ", ".join(t["function"]["name"] for t in TOOLS)
    return f"system: tools: {names}\nuser: {question}\nassistant: "


def make_record(rng: random.Random, i: int) -> dict[str, Any]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        answer = f"<tool_call>{call}</tool_call>\ntool: {a + b}\nassistant: {a + b}\n"
    else:
        answer = f"{rng.randint(20, 198)}\n"
    return {"id": f"calc-agent-{i}", "prompt": f"{a}+{b}=", "result": a + b, "answer": answer}


def demonstration(record: dict[str, Any]) -> tuple[str, str]:
    """(rendered prompt, the rest of the session) for the supervised warm-start."""
    return chat_prompt(record["prompt"]), record["answer"]
