"""Scores computed beside the stream by workers of their own (``placement.reference: own``,
``placement.reward_model: own``; docs/placement.md §11.1).

A scoring worker reads ``{run}:traj`` through a consumer group of its own, named after its scorer
(``"reference"``, ``"reward_model"``): Redis gives every group every entry, so it scores each trajectory as
soon as a server appends it, while the learner's group still holds it in the queue. It writes its numbers
to a hash keyed by the entry's stream id (``{run}:ref_logp``: log π_ref of the response tokens;
``{run}:rm_score``: the reward model's one score) and acknowledges the entry to its own group only (XACK
without XDEL: the entry is the learner's to delete). The learner fills each taken trajectory from the
hashes, waiting for any score not yet written.

- **Exactly once is the learner's**, unchanged: a worker never deletes, and scoring an entry twice writes
  the same numbers twice (a frozen model, no sampling).
- **A crash of the worker** leaves its read-but-unscored entries pending in its group; its next life reads
  its own pending entries first. The hash write and the group's ack are one transaction, so Redis keeps
  both or neither.
- **Cleaning up.** A field outlives its entry only until the learner's next checkpoint: every entry older
  than the stream's oldest is gone (trained and acked, or dead-lettered), and so are its scores
  (:meth:`StreamScores.drop_gone`).

Values are float32 little-endian: the reference's one per response token (0 on environment tokens, as the
learner's mask), the reward model's one per trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import redis

from buffer.group_stream import create_group

# Each scorer's hash, under {run}:. Its name is also its consumer group on {run}:traj and its one consumer
# there (one worker a scorer: its pending entries survive its restarts under this name).
SCORE_KEYS = {"reference": "ref_logp", "reward_model": "rm_score"}
POLL_S = 0.005  # the learner's re-read of scores still missing
# What a server records in a trajectory's meta for a reward model on its own worker: the text the model
# reads (the prompt's tokens went through the chat template and decode to other text), and the rule
# functions' total, to which the learner adds the score (tandem.rewards.total_reward).
RM_TEXT = "reward_model_text"
RULES_REWARD = "rules_reward"


def scores_key(run: str, scorer: str) -> str:
    return f"{run}:{SCORE_KEYS[scorer]}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class StreamScores:
    """One scorer's hash: written by its worker, read and dropped by the learner."""

    def __init__(self, client: redis.Redis, run: str, scorer: str) -> None:
        if scorer not in SCORE_KEYS:
            raise ValueError(f"no scores kept for {scorer!r}; one of {', '.join(SCORE_KEYS)}")
        self.client, self.run, self.scorer = client, run, scorer
        self.key, self.traj_key = scores_key(run, scorer), f"{run}:traj"

    # --------------------------------------------------------------------------------- worker side

    def ensure_group(self) -> None:
        """The worker's group, from the stream's start (idempotent): entries appended before it existed
        are scored too."""
        create_group(self.client, self.traj_key, self.scorer)

    def read(self, count: int, block_ms: int, *, pending: bool) -> list[tuple[str, bytes | None]]:
        """Up to ``count`` entries as (id, payload): the worker's own pending entries (``pending``; an
        earlier life read them and died before scoring) or new ones, waiting up to ``block_ms``. A payload
        is None for an entry the learner deleted meanwhile."""
        cursor = "0" if pending else ">"
        got = self.client.xreadgroup(
            self.scorer,
            self.scorer,
            {self.traj_key: cursor},
            count=count,
            block=None if pending else block_ms,
        )
        out = []
        for _, entries in got or ():
            for entry_id, fields in entries:
                i = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append((i, (fields or {}).get(b"d")))
        return out

    def write(self, scored: Sequence[tuple[str, np.ndarray]], done: Sequence[str]) -> None:
        """Store each ``(entry id, scores)`` and acknowledge ``done`` (the scored ids and any the worker
        skipped) to the worker's group: one transaction."""
        pipe = self.client.pipeline(transaction=True)
        if scored:
            pipe.hset(self.key, mapping={i: np.asarray(v, dtype="<f4").tobytes() for i, v in scored})
        if done:
            pipe.xack(self.traj_key, self.scorer, *done)
        pipe.execute()

    # -------------------------------------------------------------------------------- learner side

    def fetch(self, ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The scores present now for ``ids`` (the missing ones are absent)."""
        if not ids:
            return {}
        values = self.client.hmget(self.key, list(ids))
        # None is missing; b"" is an empty response's scores.
        return {
            i: np.frombuffer(v, dtype="<f4").copy() for i, v in zip(ids, values, strict=True) if v is not None
        }

    def wait(
        self, ids: Sequence[str], *, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> dict[str, np.ndarray] | None:
        """Every id's scores, polling until the worker has written them; None when ``stop`` says so first.
        Raises TimeoutError after ``timeout_s`` naming how many are missing."""
        deadline = time.monotonic() + timeout_s
        have = self.fetch(ids)
        while len(have) < len(ids):
            if stop():
                return None
            if time.monotonic() > deadline:
                missing = [i for i in ids if i not in have]
                raise TimeoutError(
                    f"{len(missing)} of {len(ids)} trajectories (e.g. {missing[0]}) have no {self.scorer} "
                    f"scores after {timeout_s:g}s: placement.{self.scorer}=own has a {self.scorer} worker "
                    f"score them; is it running (logs/{self.scorer}.log)?"
                )
            time.sleep(POLL_S)
            have |= self.fetch([i for i in ids if i not in have])
        return have

    def drop_gone(self) -> int:
        """Delete the scores of entries no longer in the stream (older than its oldest): trained and acked,
        or dead-lettered. Returns how many."""
        # The fields first, then the oldest entry: a field written after this read is never dropped, and
        # one read here whose entry is still in the stream is at or after the oldest entry.
        fields = [f.decode() if isinstance(f, bytes) else f for f in self.client.hkeys(self.key)]
        first = self.client.xrange(self.traj_key, count=1)
        if first:
            oldest = _id_key(first[0][0].decode() if isinstance(first[0][0], bytes) else first[0][0])
            fields = [f for f in fields if _id_key(f) < oldest]
        if fields:
            self.client.hdel(self.key, *fields)
        return len(fields)

    def pending(self) -> int:
        """Entries the worker read and has not scored yet (its group's pending count)."""
        try:
            return int(self.client.xpending(self.traj_key, self.scorer)["pending"])
        except redis.ResponseError:  # no group yet
            return 0
