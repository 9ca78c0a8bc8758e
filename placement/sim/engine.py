"""SIMULATION: pretend devices, and phases that sleep for modelled costs while holding them.

This machine has two cores and no GPU, so the device-level behaviour of a placement (colocated roles
taking turns, separated sides overlapping, memory as a hard limit) is shown here in simulation, and every
figure drawn from it says so. The rules:

- each pretend **device** is a lock and a memory counter. A phase holds the locks of its devices while it
  sleeps for its cost, so roles placed on the same devices serialise and roles on disjoint ones overlap,
  whatever the two real cores are doing. Allocating past a device's capacity raises :class:`SimOOM`
  naming the device;
- the **ground truth** (:mod:`placement.sim.truth`) is richer than the planner's laws, and the planner
  never reads it: it sees only the phase times and memory peaks this module measures
  (:attr:`SimRun.samples`).

:class:`SimRun` runs one plan for some steps the way tandem runs it: separated sides as two threads with a
bounded queue between them (the buffer at ``max_staleness``), colocated phases in turn on every device.
:mod:`placement.sim.auto` runs ``placement.mode: auto`` on top: a profile window of probe plans, a fit,
the best plan, and hysteresis-gated re-planning as the workload drifts.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from placement.cost import Sample, Workload, streams
from placement.plans import Plan, Roles
from placement.sim.truth import GiB, Truth


class SimOOM(MemoryError):
    """A simulated device (or the host) ran out of memory."""


class Cluster:
    """``devices`` pretend accelerators, each a lock and a memory counter, and the host's memory."""

    def __init__(self, devices: int, device_bytes: float, host_bytes: float = float("inf")) -> None:
        self.locks = [threading.Lock() for _ in range(devices)]
        self.capacity = device_bytes
        self.used = [0.0] * devices
        self.peak = [0.0] * devices
        self.host_capacity, self.host_used, self.host_peak = host_bytes, 0.0, 0.0
        self._mem = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.locks)

    @contextmanager
    def hold(self, devs: Sequence[int]) -> Iterator[None]:
        """Exclusive use of ``devs`` (locks taken in index order, so two holders never deadlock)."""
        order = sorted(set(devs))
        for d in order:
            self.locks[d].acquire()
        try:
            yield
        finally:
            for d in reversed(order):
                self.locks[d].release()

    def alloc(self, devs: Sequence[int], per_device: float, what: str) -> None:
        with self._mem:
            for d in devs:
                if self.used[d] + per_device > self.capacity:
                    raise SimOOM(
                        f"simulated device {d} out of memory: {what} needs {per_device / GiB:.2f} GiB, "
                        f"{self.used[d] / GiB:.2f} of {self.capacity / GiB:.2f} GiB in use"
                    )
            for d in devs:
                self.used[d] += per_device
                self.peak[d] = max(self.peak[d], self.used[d])

    def free(self, devs: Sequence[int], per_device: float) -> None:
        with self._mem:
            for d in devs:
                self.used[d] -= per_device

    def park(self, nbytes: float, what: str) -> None:
        """Move ``nbytes`` to host memory (an offload, a sleeping engine)."""
        with self._mem:
            if self.host_used + nbytes > self.host_capacity:
                raise SimOOM(f"simulated host out of memory: {what} parks {nbytes / GiB:.2f} GiB")
            self.host_used += nbytes
            self.host_peak = max(self.host_peak, self.host_used)

    def unpark(self, nbytes: float) -> None:
        with self._mem:
            self.host_used -= nbytes


@dataclass
class Groups:
    generation: list[int]
    learning: list[int]
    aux: list[int]

    @classmethod
    def of(cls, plan: Plan) -> Groups:
        if plan.mode == "colocate":
            every = list(range(plan.generation))
            return cls(every, every, [])
        g, n = plan.generation, plan.learning
        return cls(list(range(g)), list(range(g, g + n)), list(range(g + n, plan.devices)))


class SimRun:
    """Runs plans on a :class:`Cluster` under a :class:`Truth`, measuring what a real run would measure."""

    def __init__(
        self,
        cluster: Cluster,
        truth: Truth,
        roles: Roles,
        work_at: Callable[[int], Workload],
        *,
        seed: int = 0,
        max_staleness: int = 1,
    ) -> None:
        self.cluster, self.truth, self.roles, self.work_at = cluster, truth, roles, work_at
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self.max_staleness = max_staleness
        self.samples: list[Sample] = []  # phase times
        self.memory: list[Sample] = []  # per-device bytes of each role at its peak
        self.ends: list[float] = []  # wall time at the end of every learner step, over every plan run

    # ----------------------------------------------------------------------------------- one phase

    def _draw(self, phase: str, tokens: float, devs: Sequence[int], **kw: object) -> float:
        with self._rng_lock:
            return self.truth.time(phase, tokens, len(devs), self.rng, **kw)  # type: ignore[arg-type]

    def phase(
        self,
        name: str,
        work: Workload,
        devs: Sequence[int],
        plan: Plan,
        *,
        concurrent: int = 1,
        longest: float = 0.0,
        counted: int | None = None,
    ) -> None:
        """Sleep for the phase's cost while holding ``devs``; record what it took, on ``counted`` devices
        (default: ``devs``)."""
        tokens = work.tokens(name)
        dt = self._draw(
            name, tokens, devs, concurrent=concurrent, colocated=plan.mode == "colocate", longest=longest
        )
        with self.cluster.hold(devs):
            t0 = time.perf_counter()
            time.sleep(dt)
            took = time.perf_counter() - t0
        self.samples.append(Sample(name, tokens, counted or len(devs), took, longest, time.perf_counter()))

    @contextmanager
    def resident(
        self, role: str, work: Workload, devs: Sequence[int], *, per_token: bool = True
    ) -> Iterator[None]:
        """A role's memory on ``devs`` for the duration (its resident bytes, plus activations or KV)."""
        fixed, per_tok = self.truth.memory[role]
        nbytes = (fixed + (per_tok * work.tokens("train") if per_token else 0.0)) / len(devs)
        self.cluster.alloc(devs, nbytes, role)
        self.memory.append(Sample(role, work.tokens("train"), len(devs), nbytes))
        try:
            yield
        finally:
            self.cluster.free(devs, nbytes)

    # ----------------------------------------------------------------------------------- a step's sides

    def batch_longest(self, step: int, work: Workload) -> float:
        """The longest response of step ``step``'s batch. It is drawn from the step's own seed, so every
        plan run on this simulator meets the same batches (common random numbers): two placements differ
        by what they do with a batch, not by which batches they were dealt."""
        return float(self.truth.lengths(np.random.default_rng((self.seed, step)), work).max())

    def generate(self, plan: Plan, work: Workload, devs: Sequence[int], step: int) -> None:
        """The servers' side: decode, then what is scored next to generation."""
        longest = self.batch_longest(step, work)
        with self.resident("engine", work, devs):
            self.phase("generate", work, devs, plan, longest=longest)
            if self.roles.reference and plan.reference == "server":
                with self.resident("reference", work, devs):
                    self.phase("reference", work, devs, plan)
            if self.roles.reward_model and plan.reward_model == "server":
                with self.resident("reward_model", work, devs):
                    self.phase("reward_model", work, devs, plan)

    def learn(self, plan: Plan, work: Workload, groups: Groups) -> None:
        """The learner's side: scoring on the learning group (and own group beside it), training, sync."""
        learn, aux, roles = groups.learning, groups.aux, self.roles
        learner_roles = ["actor"]
        learner_roles += ["reference"] if roles.reference and plan.reference == "learner" else []
        learner_roles += ["critic"] if roles.critic and plan.critic == "learner" else []
        own = [] if streams(plan, roles) else plan.own(roles)
        offloaded = roles.reference and plan.reference == "learner_cpu"
        if offloaded:  # parked in host memory between uses; brought back for the scoring forwards
            self.cluster.park(self.truth.memory["reference"][0], "reference")
            self.phase("reference_reload", work, learn, plan)
            learner_roles.append("reference")
        with ExitStack() as held:
            for r in learner_roles:
                held.enter_context(self.resident(r, work, learn))
            for r in own:
                held.enter_context(self.resident(r, work, aux))
            forwards = plan.learner_scoring(roles)
            jobs: list[Callable[[], None]] = []
            if plan.scoring == "serial":
                jobs.append(lambda: [self.phase(f, work, learn, plan) for f in forwards])
            else:
                k = len(forwards)
                for f, subset in zip(forwards, _subsets(learn, k), strict=True):
                    jobs.append(lambda f=f, subset=subset: self.phase(f, work, subset, plan, concurrent=k))
            if own:
                jobs.append(
                    lambda: [self.phase({"critic": "critic_values"}.get(r, r), work, aux, plan) for r in own]
                )
            _together(jobs)
            train: list[Callable[[], None]] = [lambda: self.phase("actor_train", work, learn, plan)]
            if roles.critic:
                if plan.critic == "learner":
                    train[0] = lambda: (
                        self.phase("actor_train", work, learn, plan),
                        self.phase("critic_train", work, learn, plan),
                    )
                else:
                    train.append(lambda: self.phase("critic_train", work, aux, plan))
            _together(train)
        if offloaded:
            self.cluster.unpark(self.truth.memory["reference"][0])
        if plan.mode == "colocate":
            self.phase("sync_local", work, learn, plan)
        else:  # the broadcast pauses the servers too; logged, as a run logs it, at the learner's devices
            self.phase("sync", work, sorted({*learn, *groups.generation}), plan, counted=len(learn))

    # ----------------------------------------------------------------------------------- a plan

    def drain(self, plan: Plan) -> int:
        """The last steps of a run of ``plan`` that are not steady state.

        Separated, the servers work ``max_staleness + 1`` batches ahead (one queued, one being made),
        and each weight broadcast waits for the batch being made, so a step's end is paced by
        generation. The last ``max_staleness + 1`` steps have no batch left to wait for: counting them
        makes a generation-bound plan look faster than it runs. Colocated steps have no pipeline."""
        return 0 if plan.mode == "colocate" else max(1, self.max_staleness) + 1

    def run(self, plan: Plan, first: int, steps: int, stop: Callable[[int], bool] | None = None) -> int:
        """Run ``plan`` for steps ``first .. first + steps - 1``; ``stop(step)`` after a step ends the run
        early (a switch). Returns the steps completed."""
        groups = Groups.of(plan)
        if plan.mode == "colocate":
            return self._run_colocated(plan, groups, first, steps, stop)
        return self._run_separated(plan, groups, first, steps, stop)

    def _run_colocated(
        self, plan: Plan, groups: Groups, first: int, steps: int, stop: Callable[[int], bool] | None
    ) -> int:
        every = groups.generation
        for i in range(first, first + steps):
            work = self.work_at(i)
            self.generate(plan, work, every, i)
            # The engine sleeps (its weights and KV cache released) and the learner reloads, and back.
            parked = self.truth.memory["engine"][0]
            self.cluster.park(parked, "engine")
            self.phase("switch", work, every, plan)
            self.learn(plan, work, groups)
            self.cluster.unpark(parked)
            self.ends.append(time.perf_counter())
            if stop is not None and stop(i):
                return i - first + 1
        return steps

    def _run_separated(
        self, plan: Plan, groups: Groups, first: int, steps: int, stop: Callable[[int], bool] | None
    ) -> int:
        # The servers' batches reach the learner through the buffer; with frozen scorers alone on their own
        # group, their workers score each batch on its way (rollout/own_scorer.py), a third stage.
        streamed = streams(plan, self.roles)
        ready: queue.Queue[Workload] = queue.Queue(maxsize=max(1, self.max_staleness))
        made: queue.Queue[Workload] = queue.Queue(maxsize=1) if streamed else ready
        halt = threading.Event()
        errors: list[BaseException] = []

        def servers() -> None:
            for i in range(first, first + steps):
                work = self.work_at(i)
                self.generate(plan, work, groups.generation, i)
                if not _put(made, work, halt):
                    return

        def scorers() -> None:
            for _ in range(steps):
                if (work := _get(made, halt.is_set)) is None:
                    return
                for role in plan.own(self.roles):
                    with self.resident(role, work, groups.aux):
                        self.phase(role, work, groups.aux, plan)
                if not _put(ready, work, halt):
                    return

        stages = [_stage(servers, errors, halt)] + ([_stage(scorers, errors, halt)] if streamed else [])
        for t in stages:
            t.start()
        done = 0
        try:
            for i in range(first, first + steps):
                work = _get(ready, lambda: bool(errors))
                if errors or work is None:
                    break
                self.learn(plan, work, groups)
                self.ends.append(time.perf_counter())
                done += 1
                if stop is not None and stop(i):
                    break
        finally:
            halt.set()
            for t in stages:
                t.join()
        if errors:
            raise errors[0]
        return done


def _put(q: queue.Queue[Workload], work: Workload, halt: threading.Event) -> bool:
    """Put ``work`` on ``q``, waiting while it is full; False once ``halt`` is set."""
    while not halt.is_set():
        try:
            q.put(work, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue[Workload], halted: Callable[[], bool]) -> Workload | None:
    """The next batch on ``q``, waiting while it is empty; None once ``halted()``."""
    while not halted():
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            continue
    return None


def _stage(body: Callable[[], None], errors: list[BaseException], halt: threading.Event) -> threading.Thread:
    """A pipeline stage's thread: an error in ``body`` halts every stage and is raised in the caller's."""

    def run() -> None:
        try:
            body()
        except BaseException as e:  # surfaced in the caller's thread
            errors.append(e)
            halt.set()

    return threading.Thread(target=run, daemon=True)


def _subsets(devs: list[int], k: int) -> list[list[int]]:
    sizes = [len(devs) // k + (1 if i < len(devs) % k else 0) for i in range(k)]
    out, at = [], 0
    for s in sizes:
        out.append(devs[at : at + s])
        at += s
    return out


def _together(jobs: list[Callable[[], object]]) -> None:
    """Run ``jobs`` at once (threads), re-raising the first failure."""
    if len(jobs) == 1:
        jobs[0]()
        return
    errors: list[BaseException] = []

    def wrap(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def within(samples: Sequence[Sample], start: float, end: float) -> list[Sample]:
    """The phase times that ended between two step ends: those steps' own phases, and in a separated run
    the batches their weight broadcasts waited for. A step time measured over ``(start, end]`` and a
    prediction from these carry the same batches."""
    return [s for s in samples if start < s.at <= end]


def step_time(ends: Sequence[float], warmup: int = 2, drain: int = 0) -> float:
    """Mean seconds per step between the ends of steps ``warmup`` and ``len(ends) - 1 - drain``: leave out
    a separated run's last ``drain`` steps (:meth:`SimRun.drain`), which are not steady state."""
    steady = ends[warmup : len(ends) - drain]
    if len(steady) < 2:
        raise ValueError(f"need more than {warmup + drain + 1} steps to measure a steady step time")
    return (steady[-1] - steady[0]) / (len(steady) - 1)
