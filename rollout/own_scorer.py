"""``python -m rollout.own_scorer``: a frozen model on a worker of its own, scoring the stream
(``placement.reference: own``, ``placement.reward_model: own``; docs/placement.md §11.1).

    python -m rollout.own_scorer --role reference|reward_model --config FILE [key.sub=value ...] --run-dir DIR

Neither the reference's forward nor the reward model's needs generation's or training's output, only the
trajectory, so neither need wait for the learner's step: this process scores every trajectory as the
servers append it, on devices (CPU threads) of its own, and the learner reads the numbers instead of
running the pass (Puzzle's disjoint-device scoring, OpenRLHF's reference and reward model on node groups
of their own). One worker a role. Each iteration:

1. **read** up to ``algorithm.batch_size`` trajectories from ``{run}:traj`` through the role's own
   consumer group (its pending entries first after a restart, then new ones, waiting up to 1 s; its
   pending entries again after a wait that brought nothing);
2. **score** them with the numbers the other placements make: the reference's log π_ref of the response
   tokens (:class:`rollout.reference.ReferenceModel`), or the reward model's score of the text the server
   recorded for it (:class:`rollout.reward_model.RewardModel`);
3. **write** them to the role's hash and acknowledge the entries to its group, in one transaction
   (:class:`buffer.stream_scores.StreamScores`).

Start-up loads the model and scores one input before ``{run}:ready:<role>`` is set. SIGTERM, SIGINT or
the run's stop key end it; what it read and had not written stays pending for its next life.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from buffer.schema import SchemaError, Trajectory, decode_trajectory
from buffer.stream_scores import RM_TEXT, SCORE_KEYS, StreamScores
from rollout.reference import ReferenceModel, reference_of
from rollout.reward_model import RewardModel, reward_model_of
from tandem.config import Config, load_config
from tandem.procs import exit_with_driver
from tandem.telemetry import Telemetry, setup_logging
from tandem.timing import timed

log = logging.getLogger("rollout.own_scorer")

ROLES = tuple(SCORE_KEYS)  # a role's name: its consumer group, its ready, stats and history keys, its log
BLOCK_MS = 1_000  # longest wait for new trajectories, so a stop is seen


@dataclass
class Scorer:
    """What a role computes: one float32 array for each trajectory that it scores (``wants``)."""

    score: Callable[[list[Trajectory]], list[np.ndarray]]
    wants: Callable[[Trajectory], bool] = lambda t: True

    @staticmethod
    def of_reference(reference: ReferenceModel) -> Scorer:
        return Scorer(reference.trajectories)

    @staticmethod
    def of_reward_model(rm: RewardModel) -> Scorer:
        """The reward model's score of the prompt text + completion text the server recorded. Trajectories
        without it (environment episodes and agent sessions, which the reward model does not score) are
        acknowledged unscored."""
        return Scorer(
            lambda trajs: [
                np.array([s], dtype=np.float32) for s in rm.score([t.meta[RM_TEXT] for t in trajs])
            ],
            wants=lambda t: RM_TEXT in t.meta,
        )


class ScoringWorker:
    """Reads, scores and writes trajectories' scores for one role until stopped."""

    def __init__(
        self,
        role: str,
        scorer: Scorer,
        scores: StreamScores,
        telemetry: Telemetry,
        *,
        batch: int,
        stop: threading.Event,
    ) -> None:
        self.role, self.scorer, self.scores, self.telemetry = role, scorer, scores, telemetry
        self.batch, self.stop = batch, stop
        self.scored = 0

    def run(self) -> None:
        self.scores.ensure_group()
        pending = True  # an earlier life's unscored entries first
        while not self.stop.is_set() and not self.telemetry.stop_requested():
            entries = self.scores.read(self.batch, BLOCK_MS, pending=pending)
            if entries:
                self.score(entries)
            # Own pending entries until none is left; read again whenever nothing new came, since a Redis
            # restart can keep a delivery and lose the transaction that scored it (the learner would wait).
            pending = bool(entries) if pending else not entries

    def score(self, entries: Sequence[tuple[str, bytes | None]]) -> None:
        """Score what decodes and is this role's to score; acknowledge everything read. An entry that is
        gone (the learner deleted it) or malformed (the learner dead-letters it) has nothing to score."""
        with timed() as span:
            ids, trajs = [], []
            for entry_id, payload in entries:
                if payload is None:
                    continue
                try:
                    traj = decode_trajectory(payload)
                except SchemaError as e:
                    log.warning("entry %s: not a trajectory (%s); the learner dead-letters it", entry_id, e)
                    continue
                if self.scorer.wants(traj):
                    ids.append(entry_id)
                    trajs.append(traj)
            scored = self.scorer.score(trajs) if trajs else []
            self.scores.write(list(zip(ids, scored, strict=True)), [i for i, _ in entries])
        dt = span.seconds
        self.scored += len(trajs)
        tokens = sum(len(t.prompt_tokens) + len(t.response_tokens) for t in trajs)
        self.telemetry.log(
            {
                f"time/{self.role}": dt,
                f"{self.role}/trajectories": float(len(trajs)),
                f"{self.role}/tokens_per_s": tokens / dt if dt > 0 else 0.0,
                f"{self.role}/scored_total": float(self.scored),
            }
        )


def scorer_of(cfg: Config, role: str) -> Scorer:
    """The role's model, loaded, after one tiny forward: a broken checkpoint fails before ready."""
    if role == "reference":
        reference = reference_of(cfg)
        reference.logprobs([([0], [0])])
        return Scorer.of_reference(reference)
    if (rm := reward_model_of(cfg)) is None:
        raise ValueError("placement.reward_model=own needs model.reward_model (the checkpoint to score with)")
    rm.score(["ok"])
    return Scorer.of_reward_model(rm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exit_with_driver()  # started by launch.py: gone soon after it (tandem/procs.py)

    from rollout.server import connect_redis

    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.logging.level)
    client = connect_redis(cfg)
    scorer = scorer_of(cfg, args.role)
    telemetry = Telemetry(cfg, args.role, client, run_dir=args.run_dir)
    worker = ScoringWorker(
        args.role,
        scorer,
        StreamScores(client, cfg.run.name, args.role),
        telemetry,
        batch=cfg.algorithm.batch_size,
        stop=stop,
    )
    telemetry.mark_ready()
    log.info("%s worker ready", args.role)
    try:
        worker.run()
    finally:
        telemetry.close()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
