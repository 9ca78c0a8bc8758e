"""The rollout loop: admit, claim prompts, generate ``n`` samples each, score, append (docs/design.md §1.3, §3).

One iteration (:meth:`RolloutLoop.step`) reads top to bottom:

0. **harvest**: log the batches that have been appended since the last iteration, first waiting for one
   to finish when ``rollout.max_inflight_batches`` batches are already held;

1. **admit**: ask for admission of up to ``prompts_per_batch`` groups (AReaL's staleness control), blocking
   only for the first; this is the only place the server ever waits for the learner;
2. **take prompts**: claim as many prompts as were admitted. Admission comes first so a server never holds
   claimed prompts while it waits (they would be re-claimed by another server after ``claim_idle_ms``).
   A redelivered prompt (from a crashed server) carries that server's admission and takes none;
3. **fresh weights**: hold ``engine.version >= learner version - max_staleness`` (blocking on the weight
   subscriber if not), so ``max_staleness = 0`` is exactly the synchronous algorithm. Every change to the
   engine's weights, here, in flight and on a colocated sleep or wake, goes through ``rollout/weights.py``;
4. **generate** all groups in one engine call; with ``rollout.inflight_updates`` a weight update that
   arrives mid-call is applied between decode steps (PipelineRL) and later tokens carry its version.
   With one batch in flight, steps 4 to 6 run here, in turn. With several (an engine in its own process,
   ``max_staleness > 0``), the batch is handed to a generation thread and the iteration ends: the next
   one admits and claims the next batch while this one generates, so the engine always has work;
5. **score** with the reward functions (and the reward model, if any), shaped for over-long responses
   (``algorithm.overlong_buffer``; :class:`rollout.scoring.GroupScorer`); with ``algorithm.dynamic_sampling``
   a group of equal rewards is dropped here and its admission given back (``rollout/shaping.py``);
6. **put** each group contiguously, acknowledging its prompt in the same atomic step (with
   ``placement.reference: server``, after scoring every trajectory's reference log-probabilities). With
   several batches in flight, steps 5 and 6 run in one scoring thread, off the submission path, group by
   group: a prompt's group is scored and appended as soon as its ``n`` samples are back, while the rest of
   its batch still generates, and the groups waiting when the thread comes round share one append.

With an environment (``env.path``), steps 4 and 5 are one: :meth:`RolloutLoop.run_episodes` plays ``n``
multi-turn episodes per prompt, all batched in the engine turn by turn, and the episode's return (the sum of
its turn rewards) is the reward (docs/environments.md §10.3). Weight updates are applied between turns too.
With an agent (``agent.path``), :meth:`RolloutLoop.run_agents` runs the agent function ``n`` times per
prompt, each episode a session on the server's own API, and the sessions are the group (§10.9).

A prompt taken but not appended (stop, crash) stays pending in Redis for another server to claim; on a
clean stop the batches in flight finish and are appended first, then the rest is handed back.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

import redis
from transformers import PreTrainedTokenizerBase

from buffer.admission import Admission, extra_segments
from buffer.schema import PromptRecord, Trajectory
from buffer.streams import ClaimHeartbeat, ReplayBuffer, TakenPrompt
from rollout.engines.base import Completion, Engine, EngineExited, OnPrompt, SamplingParams
from rollout.envs.base import Task, load_env_factory
from rollout.envs.episode import Episode, EpisodeRunner
from rollout.evaluate import Evaluator
from rollout.metrics import ServerMetrics
from rollout.reference import ReferenceModel
from rollout.reward_model import RewardModel
from rollout.scoring import GroupScorer
from rollout.shaping import is_informative
from rollout.weights import EngineWeights
from tandem.config import Config
from tandem.data import prompt_screen
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry
from tandem.timing import BusyClock, Timers, Waits
from tandem.vision import ImageError, VisionProcessor, load_image, pixel_bytes
from weightsync.base import Subscriber, WeightSyncError, weights_key

if TYPE_CHECKING:
    from rollout.agents.runner import AgentRunner

log = logging.getLogger(__name__)

POLL_S = 1.0  # longest single wait (admission, prompts, weights), so a stop request is seen within ~1 s
JOIN_WAIT_S = 30.0  # longest wait for the current weights at start; then the freshness rule alone
BUSY_WINDOW_S = 1.0  # shortest span the logged engine busy fraction is measured over
ENGINE_ERROR_BACKOFF_MAX_S = 5.0  # longest pause after engine calls failed in a row
OWN_PROCESS_INFLIGHT = 3  # batches held at once by default with an engine in its own process (vllm, sglang)


@dataclass
class _Batch:
    """What the scoring thread hands back to one batch in flight: its groups appended, or the error."""

    appended: list[list[Trajectory]] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class _Unscored:
    """A group handed to the scoring thread: its prompt, its samples, its batch, and when the samples were
    back (``time.perf_counter()``)."""

    prompt: TakenPrompt
    completions: list[Completion]
    batch: _Batch
    ready: float


def sampling_params(cfg: Config) -> SamplingParams:
    """What every batch samples with: ``rollout.n_samples`` completions per prompt, as ``rollout`` says."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n_samples,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop=list(r.stop),
    )


def inflight_window(cfg: Config) -> int:
    """How many batches a server holds at once (claimed, not yet appended): ``rollout.max_inflight_batches``,
    or by default 1 for ``hf`` (in-process: a second batch competes for the same CPU) and
    ``OWN_PROCESS_INFLIGHT`` for vllm/sglang. Always 1 in sync mode (``max_staleness`` 0, exactly the
    synchronous algorithm), with environment episodes played in rounds (a round is one engine call for its
    batch, docs/environments.md §10.3), without ``inflight_updates`` (a weight update between batches would land
    inside the others) and with a pause mode that aborts requests in flight. Episodes that progress
    independently (agents, ``env.progression`` independent) send every turn as its own call, so the next
    batch's first turns fill the engine while this batch's slowest episodes are still running."""
    r = cfg.rollout
    pause = r.vllm.pause_mode if r.engine == "vllm" else r.sglang.pause_mode if r.engine == "sglang" else None
    rounds = cfg.env.path is not None and cfg.episode_progression == "rounds"
    if cfg.max_staleness == 0 or rounds or not r.inflight_updates or pause == "abort":
        return 1
    return r.max_inflight_batches or (1 if r.engine == "hf" else OWN_PROCESS_INFLIGHT)


def image_screen(
    screen: Callable[[PromptRecord], tuple[str, str] | None], vision: VisionProcessor | None
) -> Callable[[PromptRecord], tuple[str, str] | None]:
    """``screen``, and for a record with ``images`` their pixel values read and processed into its
    ``vision`` (what the engine and each trajectory carry). Dead-lettered: a record with images on an
    engine without a vision processor, an image that cannot be read here, or placeholders in its tokens
    that its images do not fill."""

    def with_images(record: PromptRecord) -> tuple[str, str] | None:
        verdict = screen(record)
        images = record.record.get("images")
        if verdict is not None or images is None or record.vision is not None:
            return verdict
        if vision is None:
            return "dead", "a record with images, and this engine has no vision processor"
        try:
            pixels = vision.pixels([load_image(e, "") for e in images])
        except (ImageError, TypeError, ValueError) as e:
            return "dead", f"images: {e}"
        have = int((record.tokens == vision.image_token_id).sum())
        if have != (want := pixels.placeholders(vision.merge_size)):
            return "dead", f"{have} image placeholder tokens; its images fill {want}"
        record.vision = pixels
        return None

    return with_images


class RolloutLoop:
    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        buffer: ReplayBuffer,
        subscriber: Subscriber,
        telemetry: Telemetry,
        *,
        server_index: int,
        rewards: RewardFunctions,
        reward_model: RewardModel | None = None,
        reference: ReferenceModel | None = None,
        metrics: ServerMetrics | None = None,
        stop_event: threading.Event | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        if reference is None and cfg.reference_scorer == "server":
            raise ValueError(
                "placement.reference=server: the rollout loop needs the reference model to score"
            )
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.buffer, self.subscriber, self.telemetry = buffer, subscriber, telemetry
        self.server_index = server_index
        self.evaluator = evaluator
        self.metrics = metrics or ServerMetrics(engine)
        self.stop_event = stop_event or threading.Event()
        self.timers = Timers()  # seconds spent in each phase since the last log (written by every thread)
        self.inflight: list[Future[list[list[Trajectory]]]] = []  # batches handed to generation threads
        self.weights = EngineWeights(
            cfg,
            engine,
            subscriber,
            metrics=self.metrics,
            timers=self.timers,
            should_stop=self.should_stop,
            idle=lambda: not self.inflight,
            server_index=server_index,
            release_also=reference.release if reference is not None else None,
        )
        self.sampling = sampling_params(cfg)
        self.scoring = GroupScorer(
            cfg,
            tokenizer,
            self.sampling,
            rewards,
            server_index=server_index,
            timers=self.timers,
            reward_model=reward_model,
            reference=reference,
        )
        self.env_factory, self.episodes = self._episode_runner()
        self.window = inflight_window(cfg)  # batches in flight
        self.agents = self._agent_runner()
        self.env_metrics: dict[str, list[float]] = defaultdict(list)
        self.admission = Admission.from_config(buffer.client, cfg, buffer.consumer)  # and its credits
        # A prompt record this model cannot take (ids out of its vocabulary, too long) is dead-lettered.
        self.screen = image_screen(
            prompt_screen(cfg.model.actor, cfg.data.max_prompt_tokens, len(tokenizer)),
            getattr(engine, "vision", None),
        )
        self.steps = self.groups = self.duplicates = self.uniform_dropped = 0
        self.engine_errors = 0  # engine calls that failed; their prompts were handed back
        self.failing = 0  # engine calls failed in a row: the next waits a little longer (no hot loop)
        self.totals = Timers()  # the same, summed over every log, with time/engine_busy and time/wall
        self.busy = BusyClock()  # wall time with at least one generation running
        self.group_waits = Waits()  # each group's seconds from its last sample back to its append
        # Its share of wall time, and the tokens and episodes per second it generates while busy (logged).
        self.engine_busy = self.tokens_per_s = self.episodes_per_s = 0.0
        self._window = [0.0, 0.0, 0, 0]  # busy s, wall s, tokens, trajectories since the last window closed
        self.generators = ThreadPoolExecutor(
            self.window, thread_name_prefix=f"rollout{server_index}-generate"
        )
        self.scoring_thread = ThreadPoolExecutor(1, thread_name_prefix=f"rollout{server_index}-score")
        self.unscored: SimpleQueue[_Unscored] = SimpleQueue()  # groups generated, not yet scored

    def _episode_runner(self) -> tuple[Callable[[], Any] | None, EpisodeRunner | None]:
        """With ``env.path``: the environment factory and the runner of its multi-turn episodes."""
        cfg, e = self.cfg, self.cfg.env
        if e.path is None:
            return None, None
        factory = load_env_factory(e.path, e.kwargs)
        runner = EpisodeRunner(
            self.engine,
            self.tokenizer,
            self.sampling,
            max_turns=e.max_turns,
            max_total_tokens=e.max_total_tokens,
            step_timeout_s=e.step_timeout_s,
            vocab_size=len(self.tokenizer),
            progression=cfg.episode_progression,
            gather_s=e.gather_ms / 1000,
        )
        return factory, runner

    def _agent_runner(self) -> AgentRunner | None:
        """With ``agent.path``: the runner of black-box agents (the SDK is imported only by agent runs)."""
        cfg = self.cfg
        if cfg.agent.path is None:
            return None
        from rollout.agents.runner import AgentRunner

        return AgentRunner(
            cfg,
            self.engine,
            self.tokenizer,
            metrics=self.metrics,
            between_batches=self.weights.poll,
            between_steps=self.weights.poll_inflight if cfg.rollout.inflight_updates else None,
            batches=self.window,
        )

    def run(self) -> None:
        """Generate until asked to stop (``stop_event``, the run's stop key); then give back admission."""
        try:
            self.adopt_credits()
            self.join_current()
            log.info("server-%d: rollout loop started at weights v%d", self.server_index, self.engine.version)
            while not self.should_stop():
                self.step()
        finally:
            self.close()

    def adopt_credits(self) -> None:
        """Take over the admission an earlier life of this server was granted and did not spend before it
        was killed (docs/design.md §3.3); without this, a few such kills could close the window for good."""
        if held := self.admission.adopt():
            log.warning(
                "server-%d: adopted %d unspent admission credits of an earlier life", self.server_index, held
            )

    def join_current(self) -> None:
        """Before the first token, take the weights the learner has now (a server joining a running run,
        docs/design.md §5.7): ``shm`` maps the latest files, a ``dist`` joiner asks the learner to publish
        again. Engines the learner drives itself (vLLM/SGLang over ``dist``) receive the next publish."""
        c = self.cfg
        if c.weight_path == "engine":
            return
        try:  # latest may drop meanwhile: a resumed learner re-publishes its checkpoint's (older) version
            self.weights.wait_for(self.subscriber.latest_version, min(c.weightsync.timeout_s, JOIN_WAIT_S))
        except WeightSyncError:  # the freshness rule (EngineWeights.ensure_fresh) still holds
            target = self.subscriber.latest_version()
            log.warning(
                "server-%d: joined at weights v%d; v%d has not arrived yet, generating anyway "
                "where admission allows",
                self.server_index,
                self.engine.version,
                target,
            )

    def step(self) -> int:
        """One admitted batch of prompt groups, generated, scored and appended: within this call when one
        batch is in flight, else in the background. Returns the groups appended (and logged) in this call."""
        self.evaluate()  # held-out prompts at the weights now held, when this version is due
        appended = self.harvest(block=len(self.inflight) >= self.window)
        # Without admission, still take prompts redelivered from a dead server: they hold its admission, and
        # enough of them can fill the whole window, which nobody could then enter (docs/design.md §1.3).
        prompts = self.take_prompts() if self.admit() else self.reclaim_prompts()
        if not prompts:
            return appended
        with ExitStack() as held:
            held.enter_context(ClaimHeartbeat(self.buffer, [p.id for p in prompts]))  # they stay ours
            if not self.weights.ensure_fresh(self.admission.freshness_floor):
                return appended
            if self.window > 1:  # the heartbeat goes with the batch; this thread admits the next one
                self.inflight.append(self.generators.submit(self.generate_score_put, prompts, held.pop_all()))
                return appended
            groups = self.generate_score_put(prompts)
        self.log(groups)
        return appended + len(groups)

    def generate_score_put(
        self, prompts: list[TakenPrompt], held: ExitStack | None = None
    ) -> list[list[Trajectory]]:
        """Steps 4 to 6 of one batch. With several batches in flight this runs in a generation thread and
        hands scoring and the append to the scoring thread, group by group as the engine finishes them;
        ``held`` (the claim heartbeat) ends with the batch."""
        with held or nullcontext():
            if self.episodes is not None or self.agents is not None:  # scored as they play (§10)
                groups = self.run_episodes(prompts) if self.episodes is not None else self.run_agents(prompts)
                finish = partial(self.put_scored, prompts, groups, [time.perf_counter()] * len(groups))
                return finish() if self.window == 1 else self.scoring_thread.submit(finish).result()
            if self.window == 1:
                return self.generate_then_score_put(prompts)
            return self.stream_groups(prompts)

    def generate_then_score_put(self, prompts: list[TakenPrompt]) -> list[list[Trajectory]]:
        """One batch in flight: generate it, then score and append all its groups in one round trip."""
        completions: list[list[Completion]] = [[] for _ in prompts]
        ready = [0.0] * len(prompts)  # when each group's samples were back

        def keep(i: int, group: list[Completion], at: float) -> None:
            completions[i], ready[i] = group, at

        self.generate_each(prompts, keep)
        done = [i for i, c in enumerate(completions) if c]  # a failed engine call reports only some
        prompts, completions, ready = (
            [prompts[i] for i in done],
            [completions[i] for i in done],
            [ready[i] for i in done],
        )
        if not prompts:
            return []
        return self.put_scored(prompts, self.scoring.score([p.prompt for p in prompts], completions), ready)

    def generate_each(
        self, prompts: list[TakenPrompt], each: Callable[[int, list[Completion], float], None]
    ) -> None:
        """Generate a batch, calling ``each(i, completions, ready)`` once per prompt as soon as its ``n``
        samples are back (``ready``: ``time.perf_counter()`` then). A prompt the engine did not report is
        passed on when the call returns. An engine call that fails (a weight update aside) does not end the
        loop: it is counted (``rollout/engine_errors``), and the prompts it did not report are handed back
        to the buffer, where the next take claims them again. An engine whose process died does end it."""
        reported = set[int]()

        def report(i: int, completions: list[Completion]) -> None:
            reported.add(i)
            each(i, completions, time.perf_counter())

        try:
            groups = self.generate(prompts, on_prompt=report)
        except (WeightSyncError, EngineExited):  # the server exits; its supervisor restarts it
            raise
        except Exception as e:
            self.engine_errors += 1
            self.failing += 1
            lost = [p.id for i, p in enumerate(prompts) if i not in reported]
            log.warning(
                "server-%d: the engine failed a batch (%s: %s); handing back %d prompt(s)",
                self.server_index,
                type(e).__name__,
                e,
                len(lost),
            )
            try:
                self.buffer.return_prompts(lost)
            except redis.RedisError as err:  # they stay pending: claimed again after claim_idle_ms
                log.warning("server-%d: could not hand back prompts: %s", self.server_index, err)
            self.stop_event.wait(min(ENGINE_ERROR_BACKOFF_MAX_S, 0.1 * 2**self.failing))
            return
        self.failing = 0
        for i, group in enumerate(groups):
            if i not in reported:
                report(i, group)

    def stream_groups(self, prompts: list[TakenPrompt]) -> list[list[Trajectory]]:
        """Generate a batch, handing each group to the scoring thread as soon as its ``n`` samples are back,
        while the engine is still generating the others; returns the batch's groups once all are appended.
        The scoring thread takes every group waiting when it comes round (:meth:`score_ready`), so a burst
        of groups costs one append round trip, not one each."""
        batch = _Batch()
        turns: list[Future[None]] = []  # one scoring-thread turn per group handed over

        def hand_over(i: int, completions: list[Completion], ready: float) -> None:
            self.unscored.put(_Unscored(prompts[i], completions, batch, ready))
            turns.append(self.scoring_thread.submit(self.score_ready))

        try:
            self.generate_each(prompts, hand_over)
        finally:  # the groups handed over are appended (or fail) before the batch ends, even if it failed
            wait(turns)
        if batch.error is not None:
            raise batch.error
        return batch.appended

    def score_ready(self) -> None:
        """Scoring thread: score and append every group waiting (steps 5 and 6), in one round trip; each
        batch gets back its appended groups, or the error that stopped them."""
        taken: list[_Unscored] = []
        while not self.unscored.empty():
            taken.append(self.unscored.get_nowait())
        if not taken:  # an earlier turn took them
            return
        prompts = [u.prompt for u in taken]
        try:
            groups = self.scoring.score([p.prompt for p in prompts], [u.completions for u in taken])
            owner = {id(g): u.batch for g, u in zip(groups, taken, strict=True)}
            for group in self.put_scored(prompts, groups, [u.ready for u in taken]):
                owner[id(group)].appended.append(group)
        except Exception as e:
            for u in taken:
                u.batch.error = e

    def put_scored(
        self, prompts: list[TakenPrompt], groups: list[list[Trajectory]], ready: list[float]
    ) -> list[list[Trajectory]]:
        """Steps 5 (dynamic sampling) and 6 of scored groups whose samples were back at ``ready``
        (``time.perf_counter()``); each group's wait since then is logged."""
        appended = self.put(*self.drop_uninformative(prompts, groups))
        self.group_waits.since(ready)
        return appended

    def harvest(self, *, block: bool = False) -> int:
        """Log the batches in flight that are done (after waiting for one, with ``block``); returns their
        groups appended. A batch that failed raises here, as it would have in a one-batch step."""
        if block and self.inflight:
            wait(self.inflight, return_when=FIRST_COMPLETED)
        appended = 0
        for done in [f for f in self.inflight if f.done()]:
            self.inflight.remove(done)
            groups = done.result()
            self.log(groups)
            appended += len(groups)
        return appended

    def drain(self) -> int:
        """Wait for every batch in flight and log it; returns their groups appended."""
        appended = 0
        while self.inflight:
            appended += self.harvest(block=True)
        return appended

    # ------------------------------------------------------------------------------------------- stages

    def admit(self) -> bool:
        """Gain admission for up to ``prompts_per_batch`` groups: wait for the first, take the rest if free
        (one Redis call when the window is open)."""
        with self.timers("time/wait_admission"):
            held = self.admission.top_up(
                self.cfg.rollout.prompts_per_batch,
                timeout_s=POLL_S,
                should_stop=self.should_stop,
                # The learner may be publishing the very version that opens admission, and a dist broadcast
                # waits for this server to join: take weights while waiting.
                while_waiting=self.weights.sleep_while_waiting,
                wake_channels=[weights_key(self.cfg.run.name, "announce")],
            )
        return held > 0

    def take_prompts(self) -> list[TakenPrompt]:
        with self.timers("time/take_prompts"):
            prompts = self.buffer.take_prompts(self.admission.credits, timeout_s=POLL_S, screen=self.screen)
        self.admission.spend(sum(not p.redelivered for p in prompts))
        return prompts

    def reclaim_prompts(self) -> list[TakenPrompt]:
        with self.timers("time/take_prompts"):
            return self.buffer.reclaim_prompts(self.cfg.rollout.prompts_per_batch, screen=self.screen)

    def generate(
        self, prompts: list[TakenPrompt], on_prompt: OnPrompt | None = None
    ) -> list[list[Completion]]:
        hook = self.weights.poll_inflight if self.cfg.rollout.inflight_updates else None
        with self.timers("time/generate"), self.busy:
            images = [p.prompt.vision for p in prompts]
            return self.engine.generate(
                [p.prompt.tokens.tolist() for p in prompts],
                self.sampling,
                between_steps=hook,
                on_prompt=on_prompt,
                **({"images": images} if any(v is not None for v in images) else {}),
            )

    def run_episodes(self, prompts: list[TakenPrompt]) -> list[list[Trajectory]]:
        """``n`` episodes per prompt, every one a fresh environment, all run together (docs/environments.md §10.3)."""
        assert self.episodes is not None and self.env_factory is not None
        n = self.sampling.n
        with self.timers("time/generate"):
            episodes = []
            for taken in prompts:
                p = taken.prompt
                task = Task(p.text, tuple(p.tokens.tolist()), p.record)
                episodes += [Episode(task, self.env_factory(), p.tokens.tolist()) for _ in range(n)]
            hook = self.weights.poll_inflight if self.cfg.rollout.inflight_updates else None
            with self.busy:
                self.episodes.run(episodes, between_steps=hook, between_turns=self.weights.poll)
        groups = []
        for k, taken in enumerate(prompts):
            group_id = uuid.uuid4().hex
            groups.append(
                [
                    e.trajectory(
                        taken.prompt.prompt_id, group_id, f"server-{self.server_index}", self.scoring.clip
                    )
                    for e in episodes[k * n : (k + 1) * n]
                ]
            )
        for e in episodes:
            self.env_metrics["env/turns"].append(e.turns)
            self.env_metrics["env/aborted"].append(float(e.finish_reason == "abort"))
            for name, value in e.metrics.items():
                self.env_metrics[f"env/{name}"].append(value)
        return groups

    def run_agents(self, prompts: list[TakenPrompt]) -> list[list[Trajectory]]:
        """``n`` agent episodes per prompt, all at once, each a session on this server (docs/environments.md §10.9)."""
        from rollout.agents.runner import AgentEpisode

        assert self.agents is not None
        n = self.sampling.n
        with self.timers("time/generate"):
            episodes = [
                AgentEpisode(t.prompt.record, t.prompt.tokens.tolist()) for t in prompts for _ in range(n)
            ]
            with self.busy:
                self.agents.run(episodes)
        server = f"server-{self.server_index}"
        groups = []
        for k, taken in enumerate(prompts):
            group_id = uuid.uuid4().hex
            group = episodes[k * n : (k + 1) * n]
            # every segment of the n episodes (docs/environments.md §10.6): one group, one append
            groups.append(
                [
                    t
                    for e in group
                    for t in e.trajectories(taken.prompt.prompt_id, group_id, server, self.scoring.clip)
                ]
            )
        for e in episodes:
            for name, value in e.metrics().items():
                self.env_metrics[name].append(value)
        return groups

    def drop_uninformative(
        self, prompts: list[TakenPrompt], groups: list[list[Trajectory]]
    ) -> tuple[list[TakenPrompt], list[list[Trajectory]]]:
        """Dynamic sampling (DAPO): a group of equal rewards is answered but not appended; its prompt is
        acknowledged and its admission given back, so a fresh group takes its place in the batch."""
        if not self.cfg.algorithm.dynamic_sampling:
            return prompts, groups
        keep = [is_informative([t.reward for t in g]) for g in groups]
        dropped = [i for i, k in enumerate(keep) if not k]
        if dropped:
            self.buffer.ack_prompts([prompts[i].id for i in dropped])
            self.admission.refund(sum(len(groups[i]) - extra_segments(groups[i]) for i in dropped))
            self.uniform_dropped += len(dropped)
        return [p for p, k in zip(prompts, keep, strict=True) if k], [
            g for g, k in zip(groups, keep, strict=True) if k
        ]

    def put(self, prompts: list[TakenPrompt], groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
        """One atomic append per group, acknowledging its prompt with it (groups stay contiguous), all in
        one round trip.

        Returns the groups appended: a group whose prompt another server already answered is refused.
        """
        self.scoring.score_reference(groups)
        with self.timers("time/put"):
            appended = []
            # An agent episode's segments past its first were not admitted with the group's n: they take
            # admission now, so the counter keeps counting what the stream holds (§10.6).
            extra = [extra_segments(g) for g in groups]
            if sum(extra):
                self.admission.charge(sum(extra))
            ids = self.buffer.put_groups(
                [(group, taken.id) for taken, group in zip(prompts, groups, strict=True)]
            )
            for taken, group, got, more in zip(prompts, groups, ids, extra, strict=True):
                if got:
                    appended.append(group)
                else:
                    if more:
                        self.admission.refund(more)
                    self.duplicates += 1
                    log.warning(
                        "server-%d: prompt %s was answered by another server; group dropped",
                        self.server_index,
                        taken.prompt.prompt_id,
                    )
        self.groups += len(appended)
        return appended

    def log(self, groups: list[list[Trajectory]]) -> None:
        """One telemetry step per batch appended, with the phase times since the last one and the engine's
        busy fraction (the share of wall time with a generation running)."""
        trajs = [t for g in groups for t in g]
        if not trajs:
            return
        tokens = sum(int(t.loss_mask.sum()) for t in trajs)  # generated tokens (env tokens are not)
        self.metrics.generated_tokens.labels(source="rollout").inc(tokens)
        self.metrics.rollout_groups.inc(len(groups))
        self.steps += 1
        timers = self.timers.take()
        busy, wall = self.busy.lap()
        for k, v in (*timers.items(), ("time/engine_busy", busy), ("time/wall", wall)):
            self.totals[k] += v
        # Batches harvested together would each see a sliver of the clock, and overlapping batches would
        # each count the others' time as theirs: rates and the busy share are over >= 1 s of wall time.
        w = self._window
        w[0], w[1], w[2], w[3] = w[0] + busy, w[1] + wall, w[2] + tokens, w[3] + len(trajs)
        if w[1] >= BUSY_WINDOW_S or self.steps == 1:
            self.engine_busy = w[0] / max(w[1], 1e-9)
            self.tokens_per_s, self.episodes_per_s = w[2] / max(w[0], 1e-9), w[3] / max(w[0], 1e-9)
            self._window = [0.0, 0.0, 0, 0]
        # From a group's last sample to its append: the rest of its batch's generation when groups are not
        # streamed, then scoring and the append (docs/design.md §1.3).
        waits = self.group_waits.take() or [0.0]
        pixels = pixel_bytes(trajs)  # images ride in every sample's trajectory, n copies per group
        self.telemetry.log(
            {
                "rollout/group_wait_s": sum(waits) / len(waits),
                "rollout/group_wait_max_s": max(waits),
                "rollout/tokens": tokens,
                "rollout/tokens_per_s": self.tokens_per_s,
                "rollout/engine_busy": self.engine_busy,
                "rollout/inflight_batches": len(self.inflight),
                "rollout/groups": self.groups,
                "rollout/duplicates_refused": self.duplicates,
                "rollout/uniform_groups_dropped": self.uniform_dropped,
                "rollout/engine_errors": self.engine_errors,
                **self.scoring.rewards.metrics(),  # reward/errors, reward/timeouts (samples scored 0), judge/...
                "rollout/version": self.engine.version,
                "rollout/response_len": tokens / len(trajs),
                # What sets a batch's decode time, whatever its devices (the planner's L, §11.2).
                "rollout/longest_response": max(int(t.loss_mask.sum()) for t in trajs),
                "rollout/stop_frac": sum(t.finish_reason == "stop" for t in trajs) / len(trajs),
                "reward/mean": sum(t.reward for t in trajs) / len(trajs),
                "rollout/episodes_per_s": self.episodes_per_s,
                **{k: sum(v) / len(v) for k, v in self.env_metrics.items()},
                **({"rollout/pixel_bytes_per_group": pixels / len(groups)} if pixels else {}),
                **timers,
                **self.metrics.engine_row(),  # server/kv_cache_usage, server/preemptions, ...
            },
            step=self.steps,
        )
        self.env_metrics.clear()

    # ---------------------------------------------------------------------------------------------- helpers

    def evaluate(self) -> None:
        if self.evaluator is not None and self.evaluator.claim(self.engine.version):
            with self.weights.held():  # no generation thread applies an update mid-evaluation
                self.evaluator.run()

    def should_stop(self) -> bool:
        return self.stop_event.is_set() or self.telemetry.stop_requested()

    def close(self) -> None:
        """Let the batches in flight finish and append; then give back admission this server holds but will
        not use, so the learner is not starved, and hand back the prompts it still holds."""
        wait(self.inflight)
        for done in self.inflight:
            try:
                self.log(done.result())
            except Exception as e:  # its prompts are handed back below
                log.warning("server-%d: a batch in flight failed: %r", self.server_index, e)
        self.inflight.clear()
        if self.agents is not None:
            self.agents.close()
        self.generators.shutdown()
        self.scoring_thread.shutdown()
        self.admission.give_back()
        try:
            returned = self.buffer.return_prompts()
        except redis.RedisError as e:  # they stay pending: another server claims them after claim_idle_ms
            log.warning("server-%d: could not hand back held prompts: %s", self.server_index, e)
        else:
            if returned:
                log.info("server-%d: handed back %d held prompt(s)", self.server_index, returned)
        log.info("server-%d: rollout loop stopped after %d groups", self.server_index, self.groups)
