"""The planner's cost model: per-role scaling laws fitted to measurements, and a plan's predicted step.

Every phase of a step (generation, each scoring forward, each training pass, the weight sync, the
colocated switch) is timed wherever it runs. The planner knows nothing else: it fits one law per phase,

    t(W, g) = α + β · W / g

(``W`` the phase's tokens per step, ``g`` its devices: a fixed cost plus perfectly divisible work), and
one per role for memory, ``bytes per device = (M + m · W) / g``. Where a batch's longest response ``L`` is
measured, generation gets a third term, ``+ γ · L``: decode steps no device count divides, priced at the
longest response per generated token over every measured batch (:attr:`CostModel.pace`). What the laws
leave out (communication that grows with ``g``, contention between colocated roles, jitter) is what the
predicted-against-measured figures show.

:func:`predict` composes the laws for one plan (docs/placement.md §11.2):

- **colocated phases add**: generate, switch, score, train, sync, switch back, all on every device;
- **separated sides overlap**: the servers' side (generation and what is scored there) against the
  learner's (scoring, training); the slower sets the pace, priced as the expected maximum of two sides
  that scatter as their phases do (:attr:`CostModel.spread`). Then the weight broadcast, which both wait
  out (the servers pause to load it);
- **scoring** is a sum (``serial``) or the slowest of disjoint subsets (``split``); roles on the ``own``
  group score and train beside the learning group;
- **memory is a hard limit**: a plan whose predicted peak exceeds a device's (or the host's) memory is
  infeasible, whatever its speed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from placement.plans import Plan, Roles

# Phases whose time the planner models, and the tokens each one processes (see Workload.tokens).
PHASES = (
    "generate",  # the rollout servers' decode (response tokens)
    "actor_logp",  # the proximal actor's no-grad forward
    "reference",  # the reference's no-grad forward
    "critic_values",  # the critic's no-grad forward
    "reward_model",  # the reward model's forward
    "actor_train",  # the actor's forward + backward + optimizer step, all epochs
    "critic_train",  # the critic's
    "sync",  # publishing the actor's weights to the servers (across devices)
    "sync_local",  # the same within a device, when colocated (shm on CPU, CUDA IPC on GPU)
    "switch",  # colocated: engine sleep + learner reload, and back (both directions, one step)
    "reference_reload",  # learner_cpu: moving the reference to the device and back
)
# Memory is per role: what each holds on its devices while it runs.
MEMORY_ROLES = ("engine", "actor", "reference", "critic", "reward_model")


@dataclass(frozen=True)
class Workload:
    """One step's work: ``samples`` trajectories of ``prompt_len`` + ``response_len`` (means) tokens."""

    samples: int
    prompt_len: float
    response_len: float

    def tokens(self, phase: str) -> float:
        """Tokens a phase processes per step: generation decodes responses, the rest read whole rows."""
        if phase == "generate":
            return self.samples * self.response_len
        return self.samples * (self.prompt_len + self.response_len)


@dataclass(frozen=True)
class Law:
    """``t = alpha + beta * W / g + gamma * L`` (seconds), or bytes per device ``(alpha + beta * W) / g``
    for memory. ``L`` is a batch's longest response: decode steps that no device count divides."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def time(self, tokens: float, devices: int, longest: float = 0.0) -> float:
        return self.alpha + self.beta * tokens / devices + self.gamma * longest

    def bytes(self, tokens: float, devices: int) -> float:
        return (self.alpha + self.beta * tokens) / devices


def fit(xs: Iterable[float], ys: Iterable[float]) -> Law:
    """Least squares ``y = alpha + beta * x`` with both terms kept non-negative (costs are never negative).

    With a single distinct ``x`` the two terms cannot be told apart; the fit then assumes no fixed cost.
    """
    x, y = np.asarray(list(xs), dtype=float), np.asarray(list(ys), dtype=float)
    if len(x) == 0:
        raise ValueError("fit: no measurements")
    if np.ptp(x) <= 1e-12 * max(1.0, abs(x).max()):
        return Law(0.0, float(y.mean() / x.mean())) if x.mean() > 0 else Law(float(y.mean()), 0.0)
    beta, alpha = np.polyfit(x, y, 1)
    if alpha < 0:  # refit through the origin
        return Law(0.0, float(max(0.0, (x @ y) / (x @ x))))
    if beta < 0:
        return Law(float(y.mean()), 0.0)
    return Law(float(alpha), float(beta))


def fit_paced(xs: Iterable[float], longest: Iterable[float], ys: Iterable[float]) -> Law:
    """Least squares ``y = alpha + beta * x + gamma * L`` with every term non-negative: the generation law
    when each batch's longest response ``L`` is known.

    With a heavy tail, the batches a probe happens to draw move its generate times more than its device
    count does. Fitted on ``x`` alone, the probes' luck would read as a slope in ``W / g`` and misprice
    every device count; with ``L`` beside it, the slope is what devices change. Exact non-negative least
    squares over three terms: the best fit among the subsets of terms whose coefficients are all
    non-negative. With a single distinct ``x`` there is no fixed cost, as in :func:`fit`."""
    x, lng, y = (np.asarray(list(v), dtype=float) for v in (xs, longest, ys))
    if len(x) == 0:
        raise ValueError("fit_paced: no measurements")
    cols = [np.ones_like(x), x, lng]
    terms = [1, 2] if np.ptp(x) <= 1e-12 * max(1.0, abs(x).max()) else [0, 1, 2]
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 2 ** len(terms)):
        use = [t for i, t in enumerate(terms) if mask >> i & 1]
        a = np.stack([cols[t] for t in use], axis=1)
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        if (coef < 0).any():
            continue
        err = float(((a @ coef - y) ** 2).sum())
        if best is None or err < best[0] - 1e-18:
            full = np.zeros(3)
            full[use] = coef
            best = (err, full)
    if best is None:  # no subset fits with non-negative terms: the mean, as a fixed cost
        return Law(float(y.mean()), 0.0)
    return Law(*(float(v) for v in best[1]))


@dataclass(frozen=True)
class Sample:
    """One measurement: ``phase`` (or memory ``role``) took ``value`` seconds (bytes per device) at W, g."""

    name: str
    tokens: float
    devices: int
    value: float
    longest: float = 0.0  # generation: the batch's longest response in tokens (0 where not logged)
    at: float = 0.0  # when the measurement ended, on the run's clock (0 where not logged)


@dataclass
class CostModel:
    """Fitted laws: one per phase for time, one per role for memory."""

    time: dict[str, Law] = field(default_factory=dict)
    memory: dict[str, Law] = field(default_factory=dict)
    # A batch's longest response per generated token, averaged over every measured batch whatever its
    # devices: the pace-setting tail, which predictions price at every device count alike.
    pace: float = 0.0
    # Each phase's spread about its law: the standard deviation of measured / predicted. A separated
    # step waits for the slower of two sides, and two sides that scatter lose more to that than their
    # means say (:func:`expected_max`).
    spread: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, times: Iterable[Sample], memory: Iterable[Sample] = ()) -> CostModel:
        by_phase: dict[str, list[Sample]] = {}
        for s in times:
            by_phase.setdefault(s.name, []).append(s)
        by_role: dict[str, list[Sample]] = {}
        for s in memory:
            by_role.setdefault(s.name, []).append(s)
        paced = [s for s in by_phase.get("generate", []) if s.longest > 0 and s.tokens > 0]
        model = cls(
            {p: _fit_phase(ss) for p, ss in by_phase.items()},
            # bytes per device * g = M + m * W: a line in W
            {r: fit((s.tokens for s in ss), (s.value * s.devices for s in ss)) for r, ss in by_role.items()},
            float(np.mean([s.longest / s.tokens for s in paced])) if paced else 0.0,
        )
        model.spread = {p: model._spread(p, ss) for p, ss in by_phase.items()}
        return model

    def _spread(self, phase: str, samples: list[Sample]) -> float:
        """Standard deviation of measured / predicted over ``samples``, each priced as a prediction is
        (generation at the mean tail, ``pace``): a batch's long response is part of the scatter."""
        law = self.time[phase]
        ratios = []
        for s in samples:
            pred = law.time(s.tokens, max(1, s.devices), self.pace * s.tokens if phase == "generate" else 0.0)
            if pred > 0:
                ratios.append(s.value / pred)
        return float(np.std(ratios, ddof=1)) if len(ratios) > 2 else 0.0

    def t(self, phase: str, work: Workload, devices: int) -> float:
        law = self.time.get(phase)
        if law is None:
            raise KeyError(f"no measurements of phase {phase!r}; the profile window must time it")
        tokens = work.tokens(phase)
        return law.time(tokens, max(1, devices), self.pace * tokens if phase == "generate" else 0.0)

    def m(self, role: str, work: Workload, devices: int) -> float:
        law = self.memory.get(role)
        return 0.0 if law is None else law.bytes(work.tokens("train"), max(1, devices))


# Phases that move weights and optimizer state (the broadcasts, the colocated switch): their bytes, not the
# batch's tokens, set their cost.
WEIGHT_PHASES = ("sync", "sync_local", "switch")


def _fit_phase(samples: list[Sample]) -> Law:
    x = [s.tokens / s.devices for s in samples]
    if any(s.longest > 0 for s in samples):
        return fit_paced(x, (s.longest for s in samples), (s.value for s in samples))
    if samples[0].name in WEIGHT_PHASES and np.ptp(x) <= 1e-12 * max(1.0, max(x)):
        # Measured at one W / g, a weight broadcast or a switch is a fixed cost: through the origin in W / g,
        # a broadcast timed from 4 learning devices would be priced twice as long from 2, and a switch
        # timed on one batch size would grow with the responses.
        return Law(float(np.mean([s.value for s in samples])), 0.0)
    return fit(x, (s.value for s in samples))


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    step_s: float  # predicted seconds per learner step
    generation_s: float  # the servers' side of a step
    learning_s: float  # the learner's side (scoring, training, sync)
    peak_bytes: float  # the largest per-device peak over every group
    host_bytes: float  # host memory the plan parks there (learner_cpu, colocated offload)
    infeasible: str | None = None  # why the plan does not fit, or None

    @property
    def feasible(self) -> bool:
        return self.infeasible is None


_SCORER_ROLE = {
    "actor_logp": "actor",
    "reference": "reference",
    "critic_values": "critic",
    "reward_model": "reward_model",
}


@dataclass(frozen=True, order=True)
class Span:
    """A span of a step: mean seconds, and its variance (independent phases add both)."""

    mean: float = 0.0
    var: float = 0.0

    def __add__(self, other: Span) -> Span:
        return Span(self.mean + other.mean, self.var + other.var)


def slower(a: Span, b: Span) -> Span:
    """max(A, B) of two independent normal spans as a span (Clark, 1961: its mean and variance): two
    groups that work side by side within a step, the step going on when both are done."""
    theta = math.sqrt(a.var + b.var)
    if theta <= 1e-12 * max(a.mean, b.mean, 1e-12):
        return max(a, b)
    z = (a.mean - b.mean) / theta
    cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    mean = a.mean * cdf + b.mean * (1 - cdf) + theta * pdf
    second = (a.mean**2 + a.var) * cdf + (b.mean**2 + b.var) * (1 - cdf) + (a.mean + b.mean) * theta * pdf
    return Span(mean, max(0.0, second - mean**2))


def expected_max(a: Span, b: Span) -> float:
    """E[max(A, B)] of two independent normal spans (:func:`slower`'s mean): ``max`` of the means when
    neither scatters, more when they are close and do. A separated step waits for the slower side each time."""
    return slower(a, b).mean


def split_devices(devices: int, k: int) -> list[int]:
    """``devices`` into ``k`` near-equal subsets (split scoring), in the order of the forwards."""
    return [devices // k + (1 if i < devices % k else 0) for i in range(k)]


def predict(
    plan: Plan,
    roles: Roles,
    model: CostModel,
    work: Workload,
    *,
    device_bytes: float = float("inf"),
    host_bytes: float = float("inf"),
) -> Prediction:
    """The plan's step time and peak memory from the fitted laws. A plan that needs a phase never measured
    cannot be predicted: it comes back infeasible, saying which."""
    try:
        return _predict(plan, roles, model, work, device_bytes, host_bytes)
    except KeyError as e:
        return Prediction(plan, float("inf"), float("inf"), float("inf"), 0.0, 0.0, str(e.args[0]))


def streams(plan: Plan, roles: Roles) -> bool:
    """Whether ``plan``'s own group is a stage of its own between generation and learning: separated, and
    holding frozen scorers only (the reference, the reward model), which need nothing from the step."""
    own = plan.own(roles)
    return plan.mode == "separate" and bool(own) and set(own) <= {"reference", "reward_model"}


def _predict(
    plan: Plan, roles: Roles, model: CostModel, work: Workload, device_bytes: float, host_bytes: float
) -> Prediction:
    """Each side's time, the step's, the memory, and why the plan does not fit (None: it does)."""
    server = _server_side(plan, roles, model, work)
    rest = _learner_side(plan, roles, model, work)
    sync = model.t("sync_local" if plan.mode == "colocate" else "sync", work, plan.learning)
    learning = rest.mean + sync
    step = _step_seconds(plan, roles, model, work, server, rest, sync, learning)
    peak, host = _memory(plan, roles, model, work)
    why = None
    if peak > device_bytes:
        why = f"needs {peak / 2**30:.2f} GiB per device, {device_bytes / 2**30:.2f} available"
    elif host > host_bytes:
        why = f"parks {host / 2**30:.2f} GiB in host memory, {host_bytes / 2**30:.2f} available"
    return Prediction(plan, step, server.mean, learning, peak, host, why)


def _phase(model: CostModel, work: Workload, name: str, devices: int) -> Span:
    """A phase's law as a span: its mean, and the variance its measured spread gives it."""
    mean = model.t(name, work, devices)
    return Span(mean, (model.spread.get(name, 0.0) * mean) ** 2)


def _server_side(plan: Plan, roles: Roles, model: CostModel, work: Workload) -> Span:
    """The servers' side: generation, then what is scored next to it."""
    server = _phase(model, work, "generate", plan.generation)
    if roles.reference and plan.reference == "server":
        server += _phase(model, work, "reference", plan.generation)
    if roles.reward_model and plan.reward_model == "server":
        server += _phase(model, work, "reward_model", plan.generation)
    return server


def _learner_side(plan: Plan, roles: Roles, model: CostModel, work: Workload) -> Span:
    """The learner's side before the weight sync: scoring on the learning group (and the own group beside
    it), then training; the own group works beside the learning group, and each waits for the slower."""
    learn_devs = plan.learning
    forwards = plan.learner_scoring(roles)
    if plan.scoring == "serial" or not forwards:
        scoring = sum((_phase(model, work, f, learn_devs) for f in forwards), Span())
    else:
        scoring = functools.reduce(
            slower,
            (
                _phase(model, work, f, g)
                for f, g in zip(forwards, split_devices(learn_devs, len(forwards)), strict=True)
            ),
        )
    if roles.reference and plan.reference == "learner_cpu":
        scoring += _phase(model, work, "reference_reload", learn_devs)
    # Frozen models alone on their own group (the reference, the reward model) score each trajectory as it
    # arrives (rollout/own_scorer.py): a pipeline stage between generation and learning, not a pass of
    # the learner's step. Sharing the group with an own critic, which works beside the step, they are
    # priced beside it, as before: the group's devices serve one phase at a time, so a batch being scored
    # holds up the critic's forward of the step.
    beside = [] if streams(plan, roles) else plan.own(roles)
    own_scoring = sum(
        (_phase(model, work, {"critic": "critic_values"}.get(r, r), plan.aux) for r in beside), Span()
    )
    train, own_train = _phase(model, work, "actor_train", learn_devs), Span()
    if roles.critic:
        if plan.critic == "learner":
            train += _phase(model, work, "critic_train", learn_devs)
        else:
            own_train = _phase(model, work, "critic_train", plan.aux)
    return slower(scoring, own_scoring) + slower(train, own_train)


def _step_seconds(
    plan: Plan,
    roles: Roles,
    model: CostModel,
    work: Workload,
    server: Span,
    rest: Span,
    sync: float,
    learning: float,
) -> float:
    """The step: colocated, the sides take turns with a switch between; separated, they work at once."""
    if plan.mode == "colocate":
        return server.mean + model.t("switch", work, plan.generation) + learning
    # The weight broadcast holds the servers too (they pause to load it), so it is on both sides'
    # path: each step both sides do their work, then the broadcast. A streamed own group is a third
    # stage, which sets the pace only when it is the slowest.
    sides = slower(server, rest)
    if streams(plan, roles):
        sides = slower(sides, sum((_phase(model, work, r, plan.aux) for r in plan.own(roles)), Span()))
    return sides.mean + sync


def _memory(plan: Plan, roles: Roles, model: CostModel, work: Workload) -> tuple[float, float]:
    """Peak bytes per device over the groups, and bytes parked in host memory; colocated sides take turns,
    so only the larger is resident."""
    m, gen_devs, learn_devs, aux = model.m, plan.generation, plan.learning, plan.aux
    server_roles = ["engine"]
    server_roles += ["reference"] if roles.reference and plan.reference == "server" else []
    server_roles += ["reward_model"] if roles.reward_model and plan.reward_model == "server" else []
    learner_roles = ["actor"]
    learner_roles += ["reference"] if roles.reference and plan.reference == "learner" else []
    learner_roles += ["critic"] if roles.critic and plan.critic == "learner" else []
    server_mem = sum(m(r, work, gen_devs) for r in server_roles)
    learner_mem = sum(m(r, work, learn_devs) for r in learner_roles)
    own_mem = sum(m(r, work, aux) for r in plan.own(roles)) if aux else 0.0
    host = m("reference", work, 1) if roles.reference and plan.reference == "learner_cpu" else 0.0
    if plan.mode == "colocate":
        peak = max(server_mem, learner_mem)
        host += min(server_mem, learner_mem) * gen_devs  # the side asleep is parked in host memory
    else:
        peak = max(server_mem, learner_mem, own_mem)
    return peak, host
