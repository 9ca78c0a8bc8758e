"""The learner's passes of a batch, one after another or at once (``placement.scoring``, ``placement.critic``;
docs/placement.md §11.1).

Before it trains, the learner makes the proximal actor's log-probabilities, the reference's and the
critic's values for every response token. These passes read the same batch and none needs another's
output, so they can run side by side (Puzzle's SMDD): ``split`` gives each pass its own thread and its own
share of the learner's CPU threads (a thread's own OpenMP team, ``torch.set_num_threads`` in that thread),
where ``serial`` runs them in turn, each with every thread. On CPU a small model's forward does not use two
threads well, so two passes on one thread each can beat the pair run in turn on two.

:func:`beside` is the one way to run work at once on shares of the threads: split scoring's passes, and
the critic placed ``own``, whose value pass and training run beside the actor's on threads of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from learner.batch import MicroBatch
from placement.cost import split_devices
from tandem.timing import Timers

# One scoring pass: its timer's name, and what it does for one micro-batch.
Pass = tuple[str, Callable[[MicroBatch], None]]


def shares(threads: int, k: int) -> list[int]:
    """``threads`` into ``k`` near-equal shares as the planner splits devices, at least one each."""
    return [max(1, n) for n in split_devices(threads, k)]


def run_passes(
    passes: Sequence[Pass], micro_batches: Sequence[MicroBatch], *, split: bool, timers: Timers
) -> None:
    """Every pass over every micro-batch: in turn (micro-batch by micro-batch), or with ``split`` each pass
    in its own thread on its share of ``torch.get_num_threads()``. Each pass's time goes to its timer
    (split: its thread's wall time, so the timers overlap and their sum exceeds the wall time)."""
    if not split or len(passes) < 2:
        for mb in micro_batches:
            for name, fill in passes:
                with timers(name):
                    fill(mb)
        return

    def one(p: Pass) -> Callable[[], None]:
        name, fill = p

        def run() -> None:
            with timers(name), torch.no_grad():
                for mb in micro_batches:
                    fill(mb)

        return run

    beside(list(zip(map(one, passes), shares(torch.get_num_threads(), len(passes)), strict=True)))


def beside(jobs: Sequence[tuple[Callable[[], None], int]]) -> None:
    """Each ``(job, threads)`` at once in a thread of its own, with its own OpenMP team of ``threads``
    (``torch.set_num_threads`` in that thread; the caller keeps its own); returns when all are done, raising
    the first failure in the caller's thread. A new thread starts with gradients on: a job that only scores
    turns them off itself."""

    def run(job: Callable[[], None], threads: int) -> None:
        torch.set_num_threads(threads)
        job()

    with ThreadPoolExecutor(len(jobs), thread_name_prefix="beside") as pool:
        for f in [pool.submit(run, job, threads) for job, threads in jobs]:
            f.result()
