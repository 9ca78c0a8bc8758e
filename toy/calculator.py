"""A tool-use environment: two-digit additions and a calculator the model may call (docs/environments.md §10.4).

Within the tiny tokenizer's alphabet. The prompt is ``"37+48="``. A model turn is either a tool call,
``c:<a>+<b>`` (the turn ends at the stop string ``"\\n"``), answered by the observation ``"=<sum>\\n"``; or
the final answer, ``a:<number>``, which ends the episode with reward 1 when it is the sum and 0 otherwise.
The tiny model cannot add two-digit numbers itself, so reward comes from calling the tool and copying its
result. A malformed call is answered with an error observation (``"error\\n"``), as a real tool's failure
would be; the episode goes on. Metrics: ``tool_calls`` (calls this episode), ``correct``.

``make_records`` writes the dataset; ``demonstrations`` are the warm-start's (prompt, completion) pairs,
half of which answer directly (usually wrongly: the point is a policy that calls the tool only sometimes,
so RL has a tool-call rate to raise).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollout.envs.base import Action, Env, StepResult, Task

CALL = re.compile(r"c:(\d{1,3})\+(\d{1,3})")
ANSWER = re.compile(r"a:(\d{1,4})")


class CalculatorEnv(Env):
    def __init__(self, error_observation: str = "error\n") -> None:
        self.error_observation = error_observation
        self.result: int | None = None
        self.calls = 0

    def reset(self, task: Task) -> str:
        self.result = int(task.record["result"])
        self.calls = 0
        return task.prompt

    def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        if m := CALL.fullmatch(text):
            self.calls += 1
            return StepResult(f"={int(m.group(1)) + int(m.group(2))}\n", 0.0, False, self.info(0.0))
        if m := ANSWER.fullmatch(text):
            correct = float(int(m.group(1)) == self.result)
            return StepResult("", correct, True, self.info(correct))
        if text.startswith("c:"):  # a call the tool cannot parse: an error, as a real tool would give
            self.calls += 1
            return StepResult(self.error_observation, 0.0, False, self.info(0.0))
        return StepResult("", 0.0, True, self.info(0.0))  # neither a call nor an answer

    def info(self, correct: float) -> dict[str, Any]:
        return {
            "metrics": {
                "tool_calls": float(self.calls),
                "tool_used": float(self.calls > 0),
                "correct": correct,
            }
        }


def make_record(rng: random.Random, i: int) -> dict[str, Any]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    tool = rng.random() < 0.5
    answer = f"c:{a}+{b}\n={a + b}\na:{a + b}" if tool else f"a:{rng.randint(20, 198)}"
    return {"id": f"calc-{i}", "prompt": f"{a}+{b}=", "result": a + b, "answer": answer}


def make_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_record(rng, i) for i in range(n)]
