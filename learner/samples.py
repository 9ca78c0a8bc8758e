"""Sampled completions: every ``logging.samples_interval`` learner steps, a few trained trajectories as text
(prompt, completion, reward and its parts) to ``<run dir>/samples.jsonl`` and a wandb table, as TRL's
``log_completions`` does.

The learner is where they are drawn: it sees every trajectory that is trained on, with its final reward
(with ``placement.reward_model: own``, the reward model's score is added there). It decodes only the few it
draws, with the actor's tokenizer; the completion is decoded as the reward saw it (special tokens skipped),
the prompt with them (the chat template, if any, as the model saw it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from buffer.schema import Trajectory
from tandem.config import Config
from tandem.telemetry import Telemetry

SAMPLES_FILE = "samples.jsonl"
COLUMNS = ("step", "prompt_id", "prompt", "completion", "reward", "reward_parts", "finish_reason")


def sample_rows(
    trajs: Sequence[Trajectory],
    decode: Callable[[list[int], bool], str],
    count: int,
    step: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    """``count`` trajectories drawn without replacement (all of them when fewer), as rows of ``COLUMNS``;
    ``decode(tokens, skip_special_tokens)`` turns token ids into text."""
    drawn = sorted(rng.sample(range(len(trajs)), min(count, len(trajs))))
    return [
        {
            "step": step,
            "prompt_id": trajs[i].prompt_id,
            "prompt": decode(trajs[i].prompt_tokens.tolist(), False),
            "completion": decode(trajs[i].response_tokens.tolist(), True),
            "reward": float(trajs[i].reward),
            "reward_parts": dict(trajs[i].reward_parts),
            "finish_reason": trajs[i].finish_reason,
        }
        for i in drawn
    ]


class CompletionSamples:
    """The learner's sampled completions: due every ``interval`` steps, appended to the run's samples file and
    logged as the wandb table ``samples``."""

    def __init__(self, cfg: Config, tokenizer: Any, telemetry: Telemetry, run_dir: str | Path) -> None:
        self.interval, self.count = cfg.logging.samples_interval, cfg.logging.samples_count
        self.tokenizer, self.telemetry = tokenizer, telemetry
        self.path = Path(run_dir) / SAMPLES_FILE
        self.rng = random.Random(cfg.run.seed)

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def log(self, step: int, trajs: Sequence[Trajectory]) -> list[dict[str, Any]]:
        """The rows of ``step`` (none when not due), written and logged."""
        if not self.due(step) or not trajs:
            return []
        rows = sample_rows(trajs, self.decode, self.count, step, self.rng)
        with self.path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        table = [[json.dumps(v) if isinstance(v, dict) else v for v in row.values()] for row in rows]
        self.telemetry.log_table("samples", list(COLUMNS), table, step=step)
        return rows

    def decode(self, tokens: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
