"""``python -m rollout.server``: one long-lived rollout server (docs/design.md §1.3).

Connected to a run (what launch.py starts; Redis URL and everything else from the config file)::

    python -m rollout.server --config FILE [key.sub=value ...] --server-id N --run-dir DIR

Standalone, a plain OpenAI-compatible inference server with no Redis, no learner and no config file::

    python -m rollout.server --standalone --model DIR [--lora NAME=DIR ...] [--host 127.0.0.1] [--port 8000]
        [--api-key K]

``--lora NAME=DIR`` serves a LoRA adapter (a peft directory) beside the base model: requests whose
``model`` is ``NAME`` take it, and rows of different adapters share the engine's batch
(rollout/engines/hf_lora.py).

Start-up fails fast (docs/design.md §6.5): Redis must answer, the engine must load and finish one tiny
generation, and the HTTP port must be bound before the server reports ready (``{run}:ready:server-N``
with its HTTP port). SIGTERM / SIGINT (or the run's stop key) end it cleanly: prompts it took but did not
answer stay pending in Redis for another server. A signal while the engine still starts aborts the start
(:func:`abort_start_on_signal`), stopping a managed vLLM or SGLang server on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import redis
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from buffer.schema import Trajectory
from placement.configured import thread_split
from rollout.engines import make_engine
from rollout.engines.base import Engine, SamplingParams
from rollout.engines.hf import DEFAULT_PREFIX_CACHE_MB, HFEngine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import Config, HTTPConfig, load_config
from tandem.fleet import Beat
from tandem.procs import exit_now, exit_with_driver
from tandem.telemetry import Telemetry, setup_logging, without_wandb

if TYPE_CHECKING:
    from buffer.streams import ReplayBuffer
    from rollout.evaluate import Evaluator
    from rollout.reference import ReferenceModel
    from tandem.rewards import RewardFunctions
    from weightsync.base import Subscriber

log = logging.getLogger("rollout.server")

REDIS_SOCKET_TIMEOUT_S = 30.0  # every Redis call fails with a clear error rather than hang


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.standalone:
        return serve_standalone(args, stop)
    exit_with_driver()  # started by launch.py: gone soon after it (tandem/procs.py)
    try:
        return serve_connected(args, stop)
    except StartAborted as e:
        log.info("stopped by %s while the engine was starting", e)
        return 0


class StartAborted(Exception):
    """A SIGTERM or SIGINT arrived while the engine was starting; its message names the signal."""


@contextlib.contextmanager
def abort_start_on_signal(stop: threading.Event) -> Iterator[None]:
    """While the engine starts, SIGTERM or SIGINT set ``stop`` and raise :class:`StartAborted` in the main
    thread. A managed vLLM or SGLang server can take minutes to answer ``/health``: without this the
    process would sleep through that wait and be SIGKILLed at the end of its supervisor's grace period;
    raised, the start's own cleanup stops the managed server. Outside, the handlers only set ``stop``."""

    def abort(signum: int, _frame: object) -> None:
        stop.set()
        raise StartAborted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, abort) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if stop.is_set():  # a signal that arrived before these handlers
            raise StartAborted("a stop before the engine started")
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_connected(args: argparse.Namespace, stop: threading.Event) -> int:
    from buffer.streams import ReplayBuffer
    from weightsync import make_subscriber

    cfg = load_config(args.config, args.overrides)
    sid, name = args.server_index, f"server-{args.server_index}"
    set_up_process(cfg, sid)
    client = connect_redis(cfg)
    if cfg.learner.lora.adapters:  # several adapters, a run each, on this one engine
        return serve_adapter_runs(cfg, args, client, stop)
    buffer = ReplayBuffer.from_config(client, cfg, consumer=name)
    subscriber = make_subscriber(cfg, client, name, run_dir=args.run_dir)
    engine, tokenizer = start_engine(cfg, client, sid, stop)
    try:
        serve_run(cfg, args, client, engine, tokenizer, buffer, subscriber, stop)
    finally:
        engine.close()
        client.close()
    return 0


def serve_run(
    cfg: Config,
    args: argparse.Namespace,
    client: redis.Redis,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    buffer: ReplayBuffer,
    subscriber: Subscriber,
    stop: threading.Event,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """One run's rollout loop on ``engine`` until it stops: its rewards, scorers, HTTP API, telemetry and
    fleet membership around it, each closed on the way out (the engine and client are the caller's).
    ``on_ready``: called once the loop is built and the server marked ready for this run."""
    from rollout.loop import RolloutLoop
    from rollout.reference import load_reference
    from rollout.reward_model import reward_model_of
    from tandem.rewards import RewardFunctions

    sid, name = args.server_index, f"server-{args.server_index}"
    rewards = RewardFunctions(cfg.reward)
    # placement.reward_model: own: the reward model worker scores instead (rollout/own_scorer.py)
    reward_model = None if "reward_model" in cfg.own_scorers else reward_model_of(cfg)
    reference = load_reference(cfg)  # placement.reference: server (docs/placement.md §11.1)
    metrics = ServerMetrics(engine)
    http = start_run_http(cfg, engine, tokenizer, metrics, sid, buffer, reference)
    telemetry = Telemetry(cfg, name, client, run_dir=args.run_dir)
    evaluator = make_evaluator(cfg, engine, tokenizer, rewards, client, name, args.run_dir)
    loop = RolloutLoop(
        cfg,
        engine,
        tokenizer,
        buffer,
        subscriber,
        telemetry,
        server_index=sid,
        rewards=rewards,
        reward_model=reward_model,
        reference=reference,
        metrics=metrics,
        stop_event=stop,
        evaluator=evaluator,
    )
    telemetry.mark_ready(http_port=http.port if http else None)
    if on_ready is not None:
        on_ready()
    fleet = Beat(client, cfg.run.name, name).start()  # counted in the fleet until it leaves (§1.8)
    log.info(
        "%s ready (engine %s, weights v%d, %d torch threads)",
        name,
        cfg.rollout.engine,
        engine.version,
        torch.get_num_threads(),
    )
    metrics.engine_stats.start()  # KV-cache use and preemptions, sampled every few seconds
    try:
        loop.run()
    finally:
        metrics.engine_stats.stop()
        fleet.stop()
        if http is not None:
            http.stop()
        subscriber.close()
        if cfg.weight_path == "engine":
            from weightsync.engine_push import unregister_engine

            unregister_engine(client, cfg.run.name, sid)
        if evaluator is not None:
            evaluator.telemetry.close()
        telemetry.close()


def serve_adapter_runs(
    cfg: Config, args: argparse.Namespace, client: redis.Redis, stop: threading.Event
) -> int:
    """``learner.lora.adapters`` (docs/stages.md §5.1): every adapter's run on one engine, which holds the
    base model and every adapter (hf: rollout/engines/hf_lora.py; vllm: LoRAs loaded by version), until they
    stop.

    Each run gets its buffer and weight subscriber (registered before the engine loads, as for one run),
    then its rollout loop on a thread of its own (its prompts, rewards, stream, admission), driving the
    engine through its :class:`AdapterEngine`; the loops' calls meet in the engine's running batch. One
    HTTP API serves each adapter under its name. The server is ready for the run as a whole once every
    adapter's loop is; one loop that fails stops the others and fails the server, which its supervisor
    restarts."""
    from buffer.streams import ReplayBuffer
    from rollout.engines.adapter_view import AdapterEngine
    from tandem import plugins
    from weightsync import make_subscriber

    name = f"server-{args.server_index}"
    runs = {a: without_http(run) for a, run in cfg.adapter_runs().items()}  # one API for all, below
    parts = {
        adapter: (
            ReplayBuffer.from_config(client, run, consumer=name),
            make_subscriber(run, client, name, run_dir=args.run_dir),
        )
        for adapter, run in runs.items()
    }
    engine, tokenizer = start_engine(cfg, client, args.server_index, stop)
    http = start_run_http(
        cfg, engine, tokenizer, ServerMetrics(engine), args.server_index, adapters=engine.adapters
    )
    ready = threading.Barrier(len(runs) + 1)
    failed: list[BaseException] = []

    def serve(adapter: str) -> None:
        buffer, subscriber = parts[adapter]
        try:
            serve_run(
                runs[adapter],
                args,
                client,
                AdapterEngine(engine, adapter),
                tokenizer,
                buffer,
                subscriber,
                stop,
                on_ready=ready.wait,
            )
        except BaseException as e:
            log.exception("adapter %s: its rollout loop failed", adapter)
            failed.append(e)
            ready.abort()  # a loop that failed before it was ready
            stop.set()

    for run in runs.values():  # imported here, one at a time: threads importing at once can deadlock
        plugins.require(plugins.check_plugins(run))
    threads = [threading.Thread(target=serve, args=(a,), name=f"adapter-{a}") for a in runs]
    for t in threads:
        t.start()
    beat = None
    try:
        with contextlib.suppress(threading.BrokenBarrierError):
            ready.wait()
            Telemetry(without_wandb(cfg), name, client).mark_ready(
                adapters=list(runs), http_port=http.port if http else None
            )
            log.info("%s ready: adapters %s on one engine", name, ", ".join(runs))
            beat = Beat(client, cfg.run.name, name).start()  # the run's fleet, as the console counts it
        for t in threads:
            t.join()
    finally:
        if beat is not None:
            beat.stop()
        if http is not None:
            http.stop()
        engine.close()
        client.close()
    if failed:
        raise failed[0]
    return 0


def without_http(cfg: Config) -> Config:
    """``cfg`` serving no HTTP API of its own."""
    return cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(
                update={"http": cfg.rollout.http.model_copy(update={"enabled": False})}
            )
        }
    )


def set_up_process(cfg: Config, sid: int) -> None:
    """Logging, seeds (one stream per server) and torch threads, before anything loads."""
    setup_logging(cfg.logging.level)
    seed_everything(cfg.run.seed + sid)
    if "OMP_NUM_THREADS" not in os.environ:  # a launcher planned our threads (and torch read them); else:
        torch.set_num_threads(thread_split(cfg)[0])


def start_engine(
    cfg: Config, client: redis.Redis, sid: int, stop: threading.Event
) -> tuple[Engine, PreTrainedTokenizerBase]:
    """The engine, registered where the learner pushes weights into engines, and warmed up: a broken one
    fails here, before the server reports ready. A signal meanwhile aborts the start (``StartAborted``)."""
    with abort_start_on_signal(stop):
        engine = make_engine(cfg, cfg.model.actor, server_index=sid)
    if cfg.weight_path == "engine":
        from weightsync.engine_push import EngineEndpoint, register_engine

        register_engine(
            client, cfg.run.name, EngineEndpoint(sid, cfg.rollout.engine, engine.url, engine.world_size())
        )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code)
    warm_up(engine, tokenizer)
    return engine, tokenizer


def start_run_http(
    cfg: Config,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    metrics: ServerMetrics,
    sid: int,
    buffer: ReplayBuffer | None = None,
    reference: ReferenceModel | None = None,
    adapters: tuple[str, ...] = (),
) -> HTTPServer | None:
    """The server's HTTP API where ``rollout.http.enabled`` (port: base + server index, or a free one).
    ``buffer``: where finished agent sessions go (none: the API serves several adapters' runs, ``adapters``,
    and no session is a trajectory of any one of them)."""
    if not cfg.rollout.http.enabled:
        return None
    port = cfg.rollout.http.port + sid if cfg.rollout.http.port else 0
    # A black-box agent's finished session is a trajectory of its own group (docs/environments.md §10.6).
    sink = None if buffer is None else (lambda t: buffer.put(reference.fill([t]) if reference else [t]))
    return start_http(
        engine,
        tokenizer,
        cfg.model.actor,
        cfg.rollout.http,
        metrics,
        port=port,
        sink=sink,
        reward_clip=cfg.reward.clip,
        adapters=adapters,
    )


def make_evaluator(
    cfg: Config,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardFunctions,
    client: redis.Redis,
    name: str,
    run_dir: str | None,
) -> Evaluator | None:
    """The held-out evaluator where ``eval.prompts`` is set, logging under its own ``eval-`` name."""
    if cfg.eval.prompts is None:
        return None
    from rollout.evaluate import Evaluator

    eval_telemetry = Telemetry(cfg, f"eval-{name}", client, run_dir=run_dir, job_type="eval")
    return Evaluator(cfg, engine, tokenizer, rewards, client, eval_telemetry)


def serve_standalone(args: argparse.Namespace, stop: threading.Event) -> int:
    try:  # the key falls back to $TANDEM_API_KEY; a bind other hosts reach is refused without one
        http_cfg = HTTPConfig(host=args.host, port=args.port, api_key=args.api_key)
    except ValidationError as e:
        raise SystemExit(f"rollout server: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    setup_logging("INFO")
    seed_everything(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.served_model_name or Path(args.model).name
    if name in args.lora:
        raise SystemExit(f"rollout server: --lora {name}=... takes the served model's own name; rename it")
    try:
        engine = HFEngine(
            args.model,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            prefix_cache_mb=args.prefix_cache_mb,
            loras=args.lora,
        )
    except ValueError as e:  # a --lora directory that is not a servable LoRA adapter
        raise SystemExit(f"rollout server: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    warm_up(engine, tokenizer)
    metrics = ServerMetrics(engine)
    http = start_http(
        engine, tokenizer, args.model, http_cfg, metrics, port=args.port, name=name, adapters=engine.adapters
    )
    metrics.engine_stats.start()
    # One parseable line for scripts and tests that started us with --port 0.
    print(f"rollout server: serving {name} on http://{http.host}:{http.port}", flush=True)
    while not stop.wait(0.5):
        pass
    metrics.engine_stats.stop()
    http.stop()
    engine.close()
    return 0


# -------------------------------------------------------------------------------------------- helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def connect_redis(cfg: Config) -> redis.Redis:
    if cfg.redis.url is None:
        raise SystemExit(
            "redis.url is not set: launch.py writes the run's Redis URL into the config it passes"
        )
    from buffer.retry import RedisUnavailable, connect_run

    # Rides out a Redis restart: lost connections are retried for supervision.reconnect_s (§6.6).
    try:
        return connect_run(
            cfg.redis.url,
            reconnect_s=cfg.supervision.reconnect_s,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
    except RedisUnavailable as e:
        raise SystemExit(str(e)) from None


def warm_up(engine: Engine, tokenizer: PreTrainedTokenizerBase) -> None:
    """One tiny generation, so a broken engine fails now rather than on the first prompt."""
    prompt = tokenizer("hello", add_special_tokens=False).input_ids or [tokenizer.eos_token_id]
    engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0))


def start_http(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    model_path: str,
    http_cfg: HTTPConfig,
    metrics: ServerMetrics,
    *,
    port: int,
    name: str | None = None,
    sink: Callable[[Trajectory], None] | None = None,
    reward_clip: float | None = None,
    adapters: tuple[str, ...] = (),
) -> HTTPServer:
    """Serve the API under the checkpoint directory's name (the full path is accepted too)."""
    model_name = name or Path(model_path).name
    hf_config = AutoConfig.from_pretrained(model_path)
    app = create_app(
        engine,
        tokenizer,
        model_name=model_name,
        http=http_cfg,
        metrics=metrics,
        max_context=hf_config.get_text_config().max_position_embeddings,  # a VL model: its text part
        aliases=(str(model_path),),
        sink=sink,
        reward_clip=reward_clip,
        adapters=adapters,
    )
    return HTTPServer(app, http_cfg.host, port).start()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rollout.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    ap.add_argument("--config", help="run config (YAML) with redis.url set; connected mode")
    ap.add_argument(
        "--server-id",
        dest="server_index",
        type=int,
        default=0,
        metavar="I",
        help="this server's index I among the run's servers: its id is server-I, its ports are base + I",
    )
    ap.add_argument("--run-dir", help="the run directory (weights fall back there when /dev/shm is absent)")
    ap.add_argument("--standalone", action="store_true", help="serve the HTTP API only: no Redis, no learner")
    ap.add_argument("--model", help="standalone: checkpoint directory")
    ap.add_argument("--served-model-name", help="standalone: model id in the API (default: directory name)")
    ap.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="standalone: serve the LoRA adapter in DIR (peft) as model NAME beside the base; repeatable",
    )
    ap.add_argument("--host", default="127.0.0.1", help="standalone: bind address")
    ap.add_argument("--port", type=int, default=8000, help="standalone: port (0 picks a free one)")
    ap.add_argument("--api-key", help="standalone: bearer token required on /v1 (or $TANDEM_API_KEY)")
    ap.add_argument("--device", default="auto", help="standalone: cpu, cuda, cuda:1, or auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="standalone: CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="standalone: MiB for the KV of finished sequences that later requests extend (0: off)",
    )
    args = ap.parse_intermixed_args(argv)
    if args.standalone and not args.model:
        ap.error("--standalone needs --model DIR")
    if not args.standalone and not args.config:
        ap.error("give --config FILE (connected to a run) or --standalone --model DIR")
    if args.lora and not args.standalone:
        ap.error("--lora serves adapters in --standalone mode only")
    args.lora = lora_modules(ap, args.lora)
    return args


def lora_modules(ap: argparse.ArgumentParser, given: list[str]) -> dict[str, str]:
    """``--lora NAME=DIR`` arguments as name -> directory; a malformed or repeated name is a usage error."""
    out: dict[str, str] = {}
    for arg in given:
        name, sep, path = arg.partition("=")
        if not sep or not name or not path:
            ap.error(f"--lora {arg!r}: give NAME=DIR")
        if name in out:
            ap.error(f"--lora {name}: given twice")
        out[name] = path
    return out


if __name__ == "__main__":
    exit_now(main())  # its work done and its files closed: skip the interpreter's teardown (tandem/procs.py)
