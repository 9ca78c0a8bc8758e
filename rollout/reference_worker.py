"""``python -m rollout.reference_worker``: the frozen reference on a worker of its own (``placement.reference:
own``, docs/design.md §11.1).

    python -m rollout.reference_worker --config FILE [key.sub=value ...] --run-dir DIR

The reference's forward has no data dependency on generation or training, so it need not wait for either:
this process scores every trajectory as the servers append it, on devices (CPU threads) of its own, and the
learner reads the numbers instead of running a reference pass (Puzzle's disjoint-device scoring, OpenRLHF's
reference on a node group of its own). Each iteration:

1. **read** up to ``algorithm.batch_size`` trajectories from ``{run}:traj`` through the worker's own
   consumer group (its pending entries first after a restart, then new ones, waiting up to 1 s; its
   pending entries again after a wait that brought nothing);
2. **score** log π_ref of their response tokens with :class:`rollout.reference.ReferenceModel`, the numbers
   the learner's reference pass and the servers' (``placement.reference: server``) make;
3. **write** them to ``{run}:ref_logp`` and acknowledge the entries to the worker's group, in one
   transaction (:class:`buffer.ref_scores.RefScores`).

Start-up loads the reference and scores one trajectory before ``{run}:ready:reference`` is set. SIGTERM,
SIGINT or the run's stop key end it; what it read and had not written stays pending for its next life.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Sequence

from buffer.ref_scores import RefScores
from buffer.schema import SchemaError, decode_trajectory
from rollout.reference import ReferenceModel, reference_of
from tandem.config import load_config
from tandem.procs import exit_with_driver
from tandem.telemetry import Telemetry, setup_logging

log = logging.getLogger("rollout.reference_worker")

ROLE = "reference"  # its role name: ready, stats and history keys, and logs/reference.log
BLOCK_MS = 1_000  # longest wait for new trajectories, so a stop is seen


class ReferenceWorker:
    """Reads, scores and writes trajectories' reference log-probabilities until stopped."""

    def __init__(
        self,
        reference: ReferenceModel,
        scores: RefScores,
        telemetry: Telemetry,
        *,
        batch: int,
        stop: threading.Event,
    ) -> None:
        self.reference, self.scores, self.telemetry = reference, scores, telemetry
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
        """Score what decodes; acknowledge everything read. An entry that is gone (the learner deleted it)
        or malformed (the learner dead-letters it) has nothing to score."""
        t0 = time.perf_counter()
        ids, trajs = [], []
        for entry_id, payload in entries:
            if payload is None:
                continue
            try:
                trajs.append(decode_trajectory(payload))
            except SchemaError as e:
                log.warning("entry %s: not a trajectory (%s); the learner dead-letters it", entry_id, e)
                continue
            ids.append(entry_id)
        scored = self.reference.trajectories(trajs)
        self.scores.write(list(zip(ids, scored, strict=True)), [i for i, _ in entries])
        dt = time.perf_counter() - t0
        self.scored += len(trajs)
        tokens = sum(len(t.response_tokens) for t in trajs)
        self.telemetry.log({
            "time/reference": dt,
            "reference/trajectories": float(len(trajs)),
            "reference/tokens_per_s": tokens / dt if dt > 0 else 0.0,
            "reference/scored_total": float(self.scored),
        })  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    reference = reference_of(cfg)
    reference.logprobs([([0], [0])])  # one tiny forward before ready: a broken checkpoint fails here
    telemetry = Telemetry(cfg, ROLE, client, run_dir=args.run_dir)
    worker = ReferenceWorker(
        reference, RefScores(client, cfg.run.name), telemetry, batch=cfg.algorithm.batch_size, stop=stop
    )
    telemetry.mark_ready()
    log.info("reference worker ready (%s)", reference.path)
    try:
        worker.run()
    finally:
        telemetry.close()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
