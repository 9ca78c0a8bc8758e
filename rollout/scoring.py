"""Step 5 of the rollout loop: a batch's completions, scored into trajectory groups (docs/design.md §1.3).

Each completion's reward is the sum of its parts (``tandem.rewards.total_reward``, the one place that sums
them):

- the reward functions on the completion's text (special tokens skipped, cut before a stop string, as the
  API returns it), and the group functions on the group's texts: every call of a batch at once, each
  under ``reward.timeout_s`` (``tandem/rewards.py``);
- the reward model's score, weighted by ``reward.model_weight``, when the server holds the reward model;
- the over-long penalty (DAPO's soft overlong punishment, ``algorithm.overlong_buffer``).

The total is clipped by ``reward.clip``. With the reward model on a worker of its own
(``placement.reward_model: own``, :mod:`rollout.own_scorer`) the trajectory carries the text it reads
and the rules' total instead, and the learner adds the worker's score (§11.1). With ``placement.reference:
server`` the reference's log-probabilities are scored here too, just before the append
(:meth:`GroupScorer.score_reference`).
"""

from __future__ import annotations

import uuid

from transformers import PreTrainedTokenizerBase

from buffer.schema import PromptRecord, Trajectory, Turns
from buffer.stream_scores import RM_TEXT, RULES_REWARD
from rollout.engines.base import Completion, SamplingParams, cut_at_stop
from rollout.reference import ReferenceModel
from rollout.reward_model import RewardModel
from rollout.shaping import overlong_penalty
from tandem.config import Config
from tandem.rewards import RewardFunctions, clip_reward, total_reward
from tandem.timing import Timers


class GroupScorer:
    """Scores one server's completions: ``n`` per prompt in, one trajectory group per prompt out."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        rewards: RewardFunctions,
        *,
        server_index: int,
        timers: Timers,
        reward_model: RewardModel | None = None,
        reference: ReferenceModel | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.sampling, self.rewards = cfg, tokenizer, sampling, rewards
        self.server_id, self.timers = f"server-{server_index}", timers
        self.reward_model, self.reference = reward_model, reference
        self.rm_own = "reward_model" in cfg.own_scorers  # a worker scores what this server appends

    def score(
        self, prompts: list[PromptRecord], completions: list[list[Completion]]
    ) -> list[list[Trajectory]]:
        """One group per prompt, each trajectory holding its reward and the parts it was summed from."""
        with self.timers("time/score"):
            a = self.cfg.algorithm
            texts = [[self.completion_text(c) for c in group] for group in completions]
            with self.timers("time/reward"):  # every reward call of the batch at once, each bounded
                scored = self.rewards.score_groups(
                    [(p.text, t, p.record) for p, t in zip(prompts, texts, strict=True)]
                )
            rm_scores = iter(self.score_reward_model(prompts, texts))
            groups = []
            for p, group, group_texts, group_scores in zip(prompts, completions, texts, scored, strict=True):
                group_id = uuid.uuid4().hex
                trajs = []
                for c, text, (rules, parts) in zip(group, group_texts, group_scores, strict=True):
                    model = overlong = None
                    if self.reward_model is not None:
                        model = parts["reward_model"] = next(rm_scores)
                    if a.overlong_buffer is not None:
                        overlong = parts["overlong"] = overlong_penalty(
                            len(c.token_ids),
                            self.sampling.max_new_tokens,
                            a.overlong_buffer,
                            a.overlong_penalty,
                        )
                    reward = total_reward(rules, self.cfg.reward, model=model, overlong=overlong)
                    traj = self.trajectory(p, c, reward, parts, group_id)
                    if self.rm_own:  # the learner adds the worker's score to these parts (§11.1)
                        traj.meta |= {RM_TEXT: p.text + text, RULES_REWARD: rules}
                    trajs.append(traj)
                groups.append(trajs)
        return groups

    def score_reward_model(self, prompts: list[PromptRecord], texts: list[list[str]]) -> list[float]:
        if self.reward_model is None:
            return []
        with self.timers("time/reward_model"):
            return self.reward_model.score(
                [p.text + t for p, g in zip(prompts, texts, strict=True) for t in g]
            )

    def score_reference(self, groups: list[list[Trajectory]]) -> None:
        """``placement.reference: server``: every trajectory's ``ref_logp``, scored where it is appended, the
        one place single-turn groups, environment episodes and agent sessions all pass."""
        if self.reference is None or not groups:
            return
        with self.timers("time/reference"):
            self.reference.fill([t for g in groups for t in g])

    def clip(self, reward: float) -> float:
        return clip_reward(reward, self.cfg.reward.clip)

    def completion_text(self, c: Completion) -> str:
        """What the reward sees: special tokens skipped, cut before a stop string (as the API returns it)."""
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return cut_at_stop(text, self.sampling.stop)[0]

    def trajectory(
        self, p: PromptRecord, c: Completion, reward: float, parts: dict[str, float], group_id: str
    ) -> Trajectory:
        turn = Turns()
        turn.add(c.token_ids, c.logprobs, c.versions, generated=True)
        traj = turn.as_trajectory(
            p.tokens,
            prompt_id=p.prompt_id,
            group_id=group_id,
            reward=reward,
            reward_parts=parts,
            finish_reason=c.finish_reason,
            server_id=self.server_id,
            meta={"version": c.versions[0]},
        )
        traj.routed_experts = c.routed_experts  # algorithm.routing_replay: the engine's routing
        if p.vision is not None:  # the pixels the engine generated from, a copy per sample (§8.4)
            arrays = p.vision.arrays()
            traj.pixel_values, traj.image_grid_thw = arrays["pixel_values"], arrays["image_grid_thw"]
        return traj
