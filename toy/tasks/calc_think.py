"""The calculator agent's task for a thinking model (configs/tiny-agent-think.yaml, docs/environments.md §10.6).

The prompts are :mod:`toy.tasks.calc_tools`' (``"37+48="``) and the agent is :mod:`toy.tasks.calc_agent`'s;
the model's chat template is ``toy/think_chat_template.jinja``, which drops the ``<think>...</think>`` of
earlier assistant turns, so a session that calls the tool becomes two segments. The warm start's
demonstrations are those segments as the template renders them: the first prompt, then a brief plan and
either a Hermes tool call (``<think>tool</think><tool_call>...``) or, half the time, a guess, usually wrong
(``<think>guess</think>123``); or the second prompt, whose history has lost the plan, then a plan and the
copied result (``<think>copy</think>85``). The warm policy thinks, and calls the tool only sometimes, so RL
has a tool-call rate to raise.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path
from typing import Any

from toy.tasks.calc_tools import chat_prompt


def make_record(rng: random.Random, i: int) -> dict[str, Any]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    first = chat_prompt(f"{a}+{b}=")
    call = "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</tool_call>"
    if rng.random() < 0.5:
        demo_prompt, answer = first, f"<think>guess</think>{rng.randint(20, 198)}\n"
    elif rng.random() < 0.5:
        demo_prompt, answer = first, f"<think>tool</think>{call}\n"
    else:  # the second segment: the history as the template renders it, without the first turn's plan
        demo_prompt, answer = f"{first}{call}\ntool: {a + b}\nassistant: ", f"<think>copy</think>{a + b}\n"
    return {
        "id": f"calc-agent-think-{i}",
        "prompt": f"{a}+{b}=",
        "result": a + b,
        "demo_prompt": demo_prompt,
        "answer": answer,
    }


def demonstration(record: dict[str, Any]) -> tuple[str, str]:
    """(rendered prompt of one segment, what the model writes next) for the supervised warm-start."""
    return record["demo_prompt"], record["answer"]


TEMPLATE = Path(__file__).resolve().parents[1] / "think_chat_template.jinja"


def with_think_template(model: str | Path, out: str | Path) -> Path:
    """A copy of the byte-level tiny model ``model`` whose tokenizer renders chats with the thinking
    template (``toy/think_chat_template.jinja``)."""
    from transformers import AutoTokenizer  # only this prepare step needs it

    out = Path(out)
    shutil.copytree(model, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":  # a prepare step of configs/tiny-agent-think.yaml
    parser = argparse.ArgumentParser(description=with_think_template.__doc__)
    parser.add_argument(
        "model", help="the byte-level tiny model's actor (python -m toy make-tiny --tokenizer bytes)"
    )
    parser.add_argument("out")
    args = parser.parse_args()
    print(f"thinking template: {with_think_template(args.model, args.out)}")
