"""The scoring forwards of a batch, one after another or at once (``placement.scoring``, docs/design.md §11.1).

Before it trains, the learner makes the proximal actor's log-probabilities, the reference's and the
critic's values for every response token. These passes read the same batch and none needs another's
output, so they can run side by side (Puzzle's SMDD): ``split`` gives each pass its own thread and its own
share of the learner's CPU threads (a thread's own OpenMP team, ``torch.set_num_threads`` in that thread),
where ``serial`` runs them in turn, each with every thread. On CPU a small model's forward does not use two
threads well, so two passes on one thread each can beat the pair run in turn on two.
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

    def one(p: Pass, threads: int) -> None:
        name, fill = p
        torch.set_num_threads(threads)  # this thread's team only: the caller keeps its own
        with timers(name), torch.no_grad():
            for mb in micro_batches:
                fill(mb)

    with ThreadPoolExecutor(len(passes), thread_name_prefix="scoring") as pool:
        done = [
            pool.submit(one, p, t)
            for p, t in zip(passes, shares(torch.get_num_threads(), len(passes)), strict=True)
        ]
        for f in done:
            f.result()  # the first failure, in the caller's thread
