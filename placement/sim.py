"""SIMULATION: pretend devices, and phases that sleep for modelled costs while holding them.

This machine has two cores and no GPU, so the device-level behaviour of a placement (colocated roles
taking turns, separated sides overlapping, memory as a hard limit) is shown here in simulation, and every
figure drawn from it says so. The rules:

- each pretend **device** is a lock and a memory counter. A phase holds the locks of its devices while it
  sleeps for its cost, so roles placed on the same devices serialise and roles on disjoint ones overlap,
  whatever the two real cores are doing. Allocating past a device's capacity raises :class:`SimOOM`
  naming the device;
- the **ground truth** (:class:`Truth`) is deliberately richer than the planner's laws: communication that
  grows with ``log2(g)``, generation held by the longest of heavy-tailed response lengths, contention
  between forwards that run at once, jitter on every phase and on switches. The planner never reads it:
  it sees only the phase times and memory peaks this module measures (:attr:`SimRun.samples`).

:class:`SimRun` runs one plan for some steps the way tandem runs it: separated sides as two threads with a
bounded queue between them (the buffer at ``max_staleness``), colocated phases in turn on every device.
:func:`run_auto` is ``placement.mode: auto`` on top: a profile window of two probe plans, a fit, the best
plan, and hysteresis-gated re-planning as the workload drifts.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from placement.cost import CostModel, Sample, Workload
from placement.local import CUDA_COPY, CUDA_FLOPS, CUDA_LINK
from placement.plan import Plan, Roles, validate
from placement.planner import Decision, Replanner, observed_ratio, rank

GiB = 2**30


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


@dataclass(frozen=True)
class PhaseTruth:
    alpha: float  # seconds of fixed cost
    beta: float  # seconds x devices per token
    comm: float = 0.0  # seconds per doubling of the devices (collectives)


@dataclass(frozen=True)
class Truth:
    """The simulator's ground truth (never shown to the planner)."""

    phases: dict[str, PhaseTruth]
    memory: dict[
        str, tuple[float, float]
    ]  # role -> (bytes resident, bytes per token), sharded over its devices
    decode_step_s: float = (
        0.0  # per decode step of the batch's longest response: latency no device count hides
    )
    tail: float = 2.5  # Pareto shape of response lengths (smaller: heavier tail)
    max_len_factor: float = 8.0  # responses are cut at this multiple of the mean (max_new_tokens)
    contention: float = 0.1  # each forward running at once with k-1 others is (1 + c (k-1)) slower
    colocated_slowdown: float = 0.03  # a colocated phase shares caches and host bandwidth with the sleeper
    jitter: float = 0.05  # log-normal sigma on every phase
    switch_jitter: float = 0.2  # log-normal sigma on sleep/wake and offload/reload
    replace_s: float = 0.05  # moving a run to another plan (restart, reshard)

    def lengths(self, rng: np.random.Generator, work: Workload) -> np.ndarray:
        """Heavy-tailed response lengths with mean ``work.response_len`` before the cut."""
        a = self.tail
        raw = (1.0 + rng.pareto(a, work.samples)) * work.response_len * (a - 1) / a
        return np.minimum(raw, self.max_len_factor * work.response_len)

    def time(
        self,
        phase: str,
        tokens: float,
        devices: int,
        rng: np.random.Generator,
        *,
        concurrent: int = 1,
        colocated: bool = False,
        longest: float = 0.0,
    ) -> float:
        p = self.phases[phase]
        t = p.alpha + p.beta * tokens / devices + p.comm * math.log2(devices) + self.decode_step_s * longest
        t *= 1 + self.contention * (concurrent - 1)
        t *= 1 + (self.colocated_slowdown if colocated else 0.0)
        sigma = self.switch_jitter if phase in ("switch", "reference_reload") else self.jitter
        return t * float(rng.lognormal(0.0, sigma))


def example_truth(*, tail: float = 2.5, decode_step_s: float = 8e-6) -> Truth:
    """A ground truth shaped like a ~1.5B-parameter actor with a critic, reference and reward model on
    80 GiB devices, with step times scaled to tens of milliseconds so a sweep runs in minutes."""
    fwd = PhaseTruth(0.0002, 0.4e-6, 0.0001)
    return Truth(
        phases={
            "generate": PhaseTruth(0.0005, 6.0e-6, 0.0001),
            "actor_logp": fwd,
            "reference": fwd,
            "critic_values": fwd,
            "reward_model": fwd,
            "actor_train": PhaseTruth(0.0003, 1.2e-6, 0.0002),
            "critic_train": PhaseTruth(0.0003, 1.2e-6, 0.0002),
            "sync": PhaseTruth(0.001, 0.0, 0.0002),
            "sync_local": PhaseTruth(0.0005, 0.0, 0.0),
            "switch": PhaseTruth(0.0015, 0.0, 0.0),
            "reference_reload": PhaseTruth(0.002, 0.0, 0.0),
        },
        memory={
            "engine": (3 * GiB, 128 * 2**10),
            "actor": (24 * GiB, 128 * 2**10),
            "reference": (3 * GiB, 64 * 2**10),
            "critic": (24 * GiB, 128 * 2**10),
            "reward_model": (3 * GiB, 64 * 2**10),
        },
        decode_step_s=decode_step_s,
        tail=tail,
    )


EXAMPLE_PARAMS = 1.5e9  # the model example_truth is shaped like


def sim_scale() -> float:
    """Simulated seconds per real second: :func:`example_truth`'s training cost per token over the cost
    table's (6 FLOPs a parameter a token at ``CUDA_FLOPS``, placement/local.py). Its forwards give the same."""
    return example_truth().phases["actor_train"].beta / (6 * EXAMPLE_PARAMS / CUDA_FLOPS)


def sized_truth(params: float, devices: int, *, tail: float = 2.5) -> Truth:
    """:func:`example_truth` for a model of ``params`` parameters (actor, critic, reference and reward
    model alike) on ``devices``, its switch priced from the bytes it moves.

    - **compute** per token grows with the parameters: :func:`example_truth`'s per-token costs and decode
      step times ``params / EXAMPLE_PARAMS`` as large; its fixed costs stay;
    - **memory**: actor and critic 16 bytes a parameter (bf16 weights, fp32 master weights, Adam), the
      engine, reference and reward model 2;
    - **bytes moved**, at the cost table's rates (``CUDA_LINK``, ``CUDA_COPY``) on the simulator's time
      scale (:func:`sim_scale`), on top of :func:`example_truth`'s fixed costs. The colocated switch: the
      learner offloads, then reloads, the actor's and critic's optimizer state and master weights (12
      bytes a parameter each, ZeRO-sharded over ``devices``) over the host link; the engine's level-2
      sleep frees its weights and KV cache and moves nothing (its weights come back by ``sync_local``).
      ``sync_local`` copies a device's share of the bf16 weights within it; ``sync`` broadcasts them
      across devices; ``reference_reload`` moves the reference's share there and back.
    """
    base, k, size = example_truth(tail=tail), sim_scale(), params / EXAMPLE_PARAMS
    weights = 2 * params
    moved = {
        "switch": 2 * 2 * 12 * params / devices / CUDA_LINK,  # actor + critic, there and back
        "sync": weights / CUDA_LINK,
        "sync_local": weights / devices / CUDA_COPY,
        "reference_reload": 2 * weights / devices / CUDA_LINK,
    }
    phases = {
        name: PhaseTruth(p.alpha + k * moved[name], 0.0, p.comm)
        if name in moved
        else PhaseTruth(p.alpha, p.beta * size, p.comm)
        for name, p in base.phases.items()
    }
    memory = {
        role: (per_param * params, base.memory[role][1])
        for role, per_param in (
            ("engine", 2),
            ("actor", 16),
            ("reference", 2),
            ("critic", 16),
            ("reward_model", 2),
        )
    }
    return replace(base, phases=phases, memory=memory, decode_step_s=base.decode_step_s * size)


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
        own = plan.own(roles)
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
        ready: queue.Queue[Workload] = queue.Queue(maxsize=max(1, self.max_staleness))
        halt = threading.Event()
        errors: list[BaseException] = []

        def servers() -> None:
            try:
                for i in range(first, first + steps):
                    work = self.work_at(i)
                    self.generate(plan, work, groups.generation, i)
                    while not halt.is_set():
                        try:
                            ready.put(work, timeout=0.05)
                            break
                        except queue.Full:
                            continue
                    if halt.is_set():
                        return
            except BaseException as e:  # surfaced in the caller's thread
                errors.append(e)
                halt.set()

        gen = threading.Thread(target=servers, daemon=True)
        gen.start()
        done = 0
        try:
            for i in range(first, first + steps):
                work = None
                while work is None and not errors:
                    try:
                        work = ready.get(timeout=0.05)
                    except queue.Empty:
                        continue
                if errors:
                    break
                self.learn(plan, work, groups)
                self.ends.append(time.perf_counter())
                done += 1
                if stop is not None and stop(i):
                    break
        finally:
            halt.set()
            gen.join()
        if errors:
            raise errors[0]
        return done


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


def relative_error(ends: Sequence[float]) -> float:
    """The standard error of the mean step between ``ends``, relative to that mean."""
    steps = np.diff(np.asarray(ends, dtype=float))
    if len(steps) < 2 or steps.mean() <= 0:
        return 0.0
    return float(steps.std(ddof=1) / math.sqrt(len(steps)) / steps.mean())


# ----------------------------------------------------------------------------------------- auto


@dataclass
class Switch:
    step: int
    plan: Plan
    predicted_s: float
    measured_s: float = float("nan")  # filled when the plan has run long enough to measure


@dataclass
class AutoResult:
    steps: int
    seconds: float
    switches: list[Switch] = field(default_factory=list)
    model: CostModel | None = None
    observed: dict[Plan, float] = field(default_factory=dict)  # measured / predicted of each plan run

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


def probe_plans(roles: Roles, devices: int) -> list[Plan]:
    """The profile window's plans: every phase timed on all devices and on half of them (the second
    also offloads the reference, so its reload is timed), and split scoring where there is any."""
    half = max(1, devices // 2)
    ref = "learner_cpu" if roles.reference else "learner"
    probes = [Plan("colocate", devices, devices), Plan("separate", half, devices - half, reference=ref)]
    split = Plan("colocate", devices, devices, scoring="split")
    if validate(split, roles, devices) is None:  # and how scoring forwards side by side slow each other
        probes.append(split)
    return probes


@dataclass(frozen=True)
class Snapshot:
    """What the planner reads from a run: its recent phase times and memory, the phase times of the
    current plan's steps, and the work now and next."""

    samples: list[Sample]
    memory: list[Sample]
    own: list[Sample]
    work_now: Workload
    work_next: Workload


Judgement = tuple[Decision, float | None]  # the decision, and the current plan's measured / predicted


def _judge(
    snap: Snapshot,
    roles: Roles,
    devices: int,
    capacity: tuple[float, float],
    observed: dict[Plan, float],
    replanner: Replanner,
    at: tuple[Plan, float | None, int, float, float],
) -> Judgement:
    """One re-planning decision, in the planner's process: refit, correct, rank, apply hysteresis."""
    current, measured, remaining, switch_s, noise = at
    model = CostModel.from_samples(snap.samples, snap.memory)
    ratio = None if measured is None else observed_ratio(current, roles, measured, snap.own, snap.work_now)
    if ratio is not None:
        observed[current] = ratio
    ranked = rank(
        roles,
        devices,
        model,
        snap.work_next,
        device_bytes=capacity[0],
        host_bytes=capacity[1],
        observed=observed,
    )
    return replanner.decide(current, ranked, remaining, switch_s, noise), ratio


def _ready() -> bool:
    return True


def run_auto(
    sim: SimRun,
    steps: int,
    *,
    profile_steps: int = 6,
    replan_every: int = 5,
    window: int = 400,
    replanner: Replanner | None = None,
) -> AutoResult:
    """``placement.mode: auto`` in simulation: profile, fit, pick, then re-plan with hysteresis."""
    replanner = replanner or Replanner()
    cluster, roles, devices = sim.cluster, sim.roles, sim.cluster.size
    # The planner runs beside the run in its own process, as the driver would: its fit and ranking are
    # milliseconds of Python that, in a thread here, would hold the GIL and delay the phases it judges.
    # It starts with the run, before any step: started at its first judgement, its imports would take
    # the cores from the very steps it then measures.
    planner = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    planner.submit(_ready).result()
    t0 = time.perf_counter()
    step = 0
    probed: dict[Plan, tuple[float, list[Sample], Workload]] = {}  # step time, phase times, work
    for probe in probe_plans(roles, devices):
        n0, s0 = len(sim.ends), len(sim.samples)
        # Two steady steps at least: a separated probe's first step ends once the pipeline has filled
        # (already past its warm-up) and its last ones are the drain.
        drain = sim.drain(probe)
        step += sim.run(probe, step, max(4, profile_steps // 2) + max(0, drain - 1))
        steady = sim.ends[n0 : len(sim.ends) - drain]
        own = within(sim.samples[s0:], steady[0], steady[-1])
        probed[probe] = (step_time(steady, 0), own, sim.work_at(step - 1))

    def refit() -> CostModel:
        return CostModel.from_samples(sim.samples[-window:], sim.memory[-window:])

    # Measured / predicted step time of every plan run so far, the probes included, each against its own
    # steps' phase times (observed_ratio): with several, their median is what composing phases generally
    # misses, and a plan's own ratio against it is what it missed for that plan.
    observed: dict[Plan, float] = {}
    for plan, (measured, own, work) in probed.items():
        if (ratio := observed_ratio(plan, roles, measured, own, work)) is not None:
            observed[plan] = ratio

    def ranked_at(i: int) -> list:
        return rank(
            roles,
            devices,
            refit(),
            sim.work_at(i),
            device_bytes=cluster.capacity,
            host_bytes=cluster.host_capacity,
            observed=observed,
        )

    best = ranked_at(step)[0]
    result = AutoResult(0, 0.0, [Switch(step, best.plan, best.step_s)])
    current = best.plan
    switch_s, switched_at = sim.truth.replace_s, None  # the cost of moving, as last measured

    def judge(i: int, current: Plan, since: tuple[int, int], done: int, switch_s: float) -> Future[Judgement]:
        ends_from, samples_from = since
        # Mid-run, the last step ended waiting for its next batch: no drain to leave out.
        ends = sim.ends[ends_from:]
        measured = step_time(ends, warmup=0) if done > 3 else None
        noise = relative_error(ends) if done > 3 else 0.0
        return planner.submit(
            _judge,
            Snapshot(
                sim.samples[-window:],
                sim.memory[-window:],
                within(sim.samples[samples_from:], ends[0], ends[-1]),
                sim.work_at(i),
                sim.work_at(i + 1),
            ),
            roles,
            devices,
            (cluster.capacity, cluster.host_capacity),
            dict(observed),
            replanner,
            (current, measured, steps - i - 1, switch_s, noise),
        )

    while step < steps:
        run_from, ends_from, samples_from = step, len(sim.ends), len(sim.samples)
        decision = None
        pending: list[Future[Judgement]] = []  # at most one judgement in flight for this plan

        def stop(
            i: int,
            run_from: int = run_from,
            since: tuple[int, int] = (ends_from, samples_from),
            current: Plan = current,
            switch_s: float = switch_s,
            pending: list[Future[Judgement]] = pending,
        ) -> bool:
            nonlocal decision
            if pending and pending[0].done():
                d, ratio = pending.pop().result()
                if ratio is not None:
                    observed[current] = ratio
                if d.switch and i + 1 < steps:
                    decision = d
                    return True
            done = i - run_from + 1
            if not pending and done % replan_every == 0 and i + 1 < steps:
                pending.append(judge(i, current, since, done, switch_s))
            return False

        step += sim.run(current, step, steps - step, stop)
        ends = sim.ends[ends_from:]
        if len(ends) > 3 + sim.drain(current):
            result.switches[-1].measured_s = step_time(ends, 2, sim.drain(current))
            if switched_at is not None:  # what moving cost: restart plus the first step's lost overlap
                switch_s = max(switch_s, ends[0] - switched_at - result.switches[-1].measured_s)
        switched_at = None
        if decision is not None:
            switched_at = sim.ends[-1]
            time.sleep(sim.truth.replace_s)  # restart the roles under the new plan
            current = decision.plan
            result.switches.append(Switch(step, current, decision.predicted_s))
    planner.shutdown(wait=True)
    result.steps, result.seconds, result.model = step, time.perf_counter() - t0, refit()
    result.observed = observed
    return result
