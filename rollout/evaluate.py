"""Held-out evaluation on the rollout servers, between rollout batches, at a known weight version.

Every ``eval.interval`` versions one server (whichever first claims ``{run}:eval:{v}`` with SET NX)
generates ``eval.n_samples`` completions for every prompt of ``eval.prompts`` with the weights of version
``v`` (no in-flight update during it), scores them with the run's reward functions, and logs, at step
``v``, ``eval/reward_mean``, ``eval/pass@1`` and ``eval/pass@k`` (k = n_samples; a sample passes when its
reward reaches ``eval.pass_threshold``) under its own process name ``eval-server-i`` (wandb and Redis).
Evaluation never takes admission and never appends to the trajectory stream: it is never trained on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import redis
from transformers import PreTrainedTokenizerBase

from rollout.engines.base import Engine, SamplingParams, cut_at_stop
from tandem.config import Config
from tandem.data import load_prompts, prompt_token_ids
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry
from tandem.timing import timed

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn from n (c of them correct) is correct: the unbiased
    estimator ``1 − C(n−c, k) / C(n, k)`` of Chen et al. (2021), as a stable product."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass
class EvalResult:
    version: int
    reward_mean: float
    pass_at_1: float
    pass_at_k: float
    k: int
    prompts: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {
            "eval/version": self.version,
            "eval/reward_mean": self.reward_mean,
            "eval/pass@1": self.pass_at_1,
            f"eval/pass@{self.k}": self.pass_at_k,
            "eval/prompts": self.prompts,
            "time/eval": self.seconds,
        }


class Evaluator:
    """The held-out prompts of a run, tokenised once, and how to score them at one version."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RewardFunctions,
        client: redis.Redis,
        telemetry: Telemetry,
    ) -> None:
        e = cfg.eval
        if e.prompts is None:
            raise ValueError("eval.prompts is not set: there is nothing to evaluate")
        self.cfg, self.engine, self.tokenizer, self.rewards = cfg, engine, tokenizer, rewards
        self.client, self.telemetry = client, telemetry
        self.records = load_prompts(e.prompts, cfg.data.prompt_field)
        self.tokens = [
            prompt_token_ids(tokenizer, r[cfg.data.prompt_field], chat_template=cfg.data.chat_template)
            for r in self.records
        ]
        self.sampling = SamplingParams(
            n=e.n_samples,
            max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
            temperature=e.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            stop=list(cfg.rollout.stop),
            seed=cfg.run.seed,
        )
        self._last_asked = -1

    def claim(self, version: int) -> bool:
        """True for the one server that evaluates ``version`` (a multiple of ``eval.interval``)."""
        if version % self.cfg.eval.interval or version == self._last_asked:
            return False
        self._last_asked = version
        key = f"{self.cfg.run.name}:eval:{version}"
        return bool(self.client.set(key, self.telemetry.proc, nx=True))

    def run(self) -> EvalResult:
        version = self.engine.version
        with timed() as span:
            out = self.engine.generate(self.tokens, self.sampling)  # no between_steps: one version throughout
            rewards, passes = [], []
            for rec, group in zip(self.records, out, strict=True):
                prompt = rec[self.cfg.data.prompt_field]
                texts = [self.text(c.token_ids) for c in group]
                scores = [total for total, _ in self.rewards.score_group(prompt, texts, rec)]
                rewards.extend(scores)
                passes.append(sum(s >= self.cfg.eval.pass_threshold for s in scores))
        n = self.sampling.n
        result = EvalResult(
            version=version,
            reward_mean=sum(rewards) / len(rewards),
            pass_at_1=sum(pass_at_k(n, c, 1) for c in passes) / len(passes),
            pass_at_k=sum(pass_at_k(n, c, n) for c in passes) / len(passes),
            k=n,
            prompts=len(passes),
            seconds=span.seconds,
        )
        self.telemetry.log(result.metrics(), step=version)
        log.info(
            "eval at v%d: reward %.3f, pass@1 %.3f, pass@%d %.3f over %d prompts (%.1fs)",
            version,
            result.reward_mean,
            result.pass_at_1,
            n,
            result.pass_at_k,
            result.prompts,
            result.seconds,
        )
        return result

    def text(self, token_ids: list[int]) -> str:
        return cut_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.sampling.stop)[0]
