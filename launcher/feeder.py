"""The prompt set and the feeder that keeps ``{run}:prompts`` topped up (docs/design.md §1.2)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tandem.config import Config, ConfigError

log = logging.getLogger("launch")


@dataclass
class PromptSet:
    """The dataset's records and their token ids, checked against ``data.max_prompt_tokens`` up front;
    ``rejected``: the bad records set aside under ``data.on_bad_record: skip``."""

    records: list[dict]
    tokens: list[list[int]]
    rejected: list = field(default_factory=list)  # tandem.data.Rejected
    adapters: dict[str, PromptSet] = field(default_factory=dict)  # learner.lora.adapters: each run's own

    @classmethod
    def load(cls, cfg: Config) -> PromptSet:
        """Raises ConfigError naming the record and field, before any process starts. With
        ``learner.lora.adapters``, each adapter's run's prompts too (``adapters``)."""
        prompts = cls._load(cfg)
        for name, run in cfg.adapter_runs().items():
            try:
                prompts.adapters[name] = cls._load(run)
            except ConfigError as e:
                raise ConfigError(f"learner.lora.adapters {name}: {e}") from None
        return prompts

    @classmethod
    def _load(cls, cfg: Config) -> PromptSet:
        from transformers import AutoTokenizer

        from tandem.data import DatasetError, Rejected, prompt_records, prompt_token_ids, raw_line

        d = cfg.data
        rejected: list[Rejected] | None = [] if d.on_bad_record == "skip" else None
        try:
            records = prompt_records(d.prompts, d.prompt_field, rejected=rejected)
        except DatasetError as e:
            raise ConfigError(f"data.prompts: {e}") from None
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        )
        if d.chat_template and not tokenizer.chat_template:
            raise ConfigError(f"data.chat_template: the tokenizer of {cfg.model.actor} has no chat template")
        vision = vision_processor(cfg, [rec for _, rec in records])
        base = Path(d.prompts).resolve().parent
        kept, tokens = [], []
        for lineno, rec in records:
            try:
                if "images" in rec:  # assert: vision is not None (vision_processor refuses otherwise)
                    ids = image_prompt_ids(vision, rec, d.prompt_field, base, chat_template=d.chat_template)
                else:
                    ids = prompt_token_ids(tokenizer, rec[d.prompt_field], chat_template=d.chat_template)
            except Exception as e:  # whatever the tokenizer raises on is this record's problem
                field_name, reason = "data.prompts", f"cannot be tokenised: {type(e).__name__}: {e}"
            else:
                if len(ids) <= d.max_prompt_tokens:
                    kept.append(rec)
                    tokens.append(ids)
                    continue
                field_name = "data.max_prompt_tokens"
                reason = f"record {rec['id']} has {len(ids)} tokens > {d.max_prompt_tokens}"
            if rejected is None:
                raise ConfigError(f"{field_name}: {d.prompts}:{lineno}: {reason}")
            rejected.append(Rejected(lineno, reason, raw_line(d.prompts, lineno)))
        if not kept:
            raise ConfigError(
                f"data.prompts: {d.prompts}: no usable records ({len(rejected or [])} set aside)"
            )
        if rejected:
            rejected.sort(key=lambda r: r.line)
            log.warning(
                "data.on_bad_record=skip: %d bad record(s) of %s set aside (first: line %d, %s)",
                len(rejected),
                d.prompts,
                rejected[0].line,
                rejected[0].reason,
            )
        return cls(kept, tokens, rejected or [])

    def write_rejected(self, run_dir: Path) -> Path | None:
        """``<run dir>/rejected_prompts.jsonl``: each record set aside, with its line and reason."""
        if not self.rejected:
            return None
        path = run_dir / "rejected_prompts.jsonl"
        path.write_text("".join(r.to_json() for r in self.rejected))
        return path


def vision_processor(cfg: Config, records: list[dict]) -> Any:
    """The actor's :class:`tandem.vision.VisionProcessor` when some record has ``images``, else None.

    ConfigError, naming the field, where such records cannot be generated from: an actor without a vision
    tower, an engine other than hf, multi-turn episodes (env.path, agent.path), or the rollout servers'
    reference (``placement.reference: server``), which is scored without the images."""
    if not any("images" in rec for rec in records):
        return None
    from tandem.vision import VisionProcessor, is_vision_checkpoint

    where = f"data.prompts: {cfg.data.prompts} has records with images"
    if not is_vision_checkpoint(cfg.model.actor):
        raise ConfigError(f"model.actor: {cfg.model.actor} has no vision tower; {where}")
    if cfg.rollout.engine != "hf":
        raise ConfigError(
            f"rollout.engine: only the hf engine generates from images (got {cfg.rollout.engine}); {where}"
        )
    if cfg.env.path is not None or cfg.agent.path is not None:
        raise ConfigError(f"env.path / agent.path: episodes with images are not supported; {where}")
    if cfg.recipe == "ppo" and cfg.reference_scorer in ("server", "own"):
        raise ConfigError(
            f"placement.reference: only the learner scores the reference from the images; {where}"
        )
    return VisionProcessor.from_pretrained(cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code)


def image_prompt_ids(
    vision: Any, rec: dict, prompt_field: str, base: Path, *, chat_template: bool
) -> list[int]:
    """A record with images as token ids holding its expanded image placeholders, what the rollout server
    generates from (:meth:`VisionProcessor.encode`). Its ``images`` paths become absolute in place, so that
    a rollout server reads them wherever it runs (on the same file system)."""
    from tandem.vision import load_image

    entries = [e if e[:5].lower() == "data:" else str(base / e) for e in rec["images"]]
    ids, _ = vision.encode(
        rec[prompt_field], [load_image(e, base) for e in entries], chat_template=chat_template
    )
    rec["images"] = entries
    return ids


class PromptFeeder:
    """Keeps the prompt stream a few batches deep, pass after pass over the dataset (seeded shuffles).

    Its position (pass, index) lives in Redis, so a resumed run continues where it stopped. Prompts and
    position move together in one compare-and-set script, so a Redis crash or a retried call neither
    skips nor repeats a prompt (docs/design.md §6.6).
    """

    def __init__(self, cfg: Config, prompts: PromptSet, buffer, client: redis.Redis) -> None:
        self.cfg, self.buffer, self.client = cfg, buffer, client
        self.records, self.tokens = prompts.records, prompts.tokens
        groups_per_step = cfg.algorithm.batch_size // cfg.rollout.n_samples
        # Deep enough that servers never wait on the feeder between two top-ups (prompts are tiny records).
        self.depth = max(
            256, 16 * groups_per_step, 16 * cfg.rollout.num_servers * cfg.rollout.prompts_per_batch
        )
        self.key = f"{cfg.run.name}:feeder"
        self._order: tuple[int, list[int]] | None = None  # (pass, order) of the pass being fed

    def order(self, epoch: int) -> list[int]:
        """The records' order in pass ``epoch``: a shuffle seeded by (run seed, pass), made once per pass."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.records)))
            if self.cfg.data.shuffle:
                random.Random(self.cfg.run.seed * 100_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def top_up(self) -> int:
        """Append prompts until the stream is ``depth`` deep again; returns how many."""
        from buffer.schema import PromptRecord

        missing = self.depth - self.buffer.prompts_pending()
        if missing <= 0:
            return 0
        saved = self.client.hmget(self.key, "epoch", "index")
        epoch, index = (int(saved[0]), int(saved[1])) if saved[0] is not None else (0, 0)
        at = (epoch, index)
        batch = []
        while len(batch) < missing and epoch < self.cfg.data.epochs:
            i = self.order(epoch)[index]
            rec = self.records[i]
            batch.append(
                PromptRecord(
                    prompt_id=f"{rec['id']}@{epoch}",
                    text=rec[self.cfg.data.prompt_field],
                    tokens=self.tokens[i],
                    record=rec,
                )
            )
            index += 1
            if index == len(self.records):
                epoch, index = epoch + 1, 0
        if batch and self.buffer.feed_prompts(batch, position_key=self.key, at=at, to=(epoch, index)) < 0:
            return 0  # the position moved since it was read (a retried top-up that had run): nothing twice
        return len(batch)


class Feeders:
    """The run's prompt feeders: its own, or with ``learner.lora.adapters`` one per adapter's run."""

    def __init__(self, cfg: Config, prompts: PromptSet, client: redis.Redis) -> None:
        from buffer.streams import ReplayBuffer

        runs = cfg.adapter_runs()
        feeds = [(run, prompts.adapters[name]) for name, run in runs.items()] or [(cfg, prompts)]
        self.feeders = [
            PromptFeeder(run, p, ReplayBuffer.from_config(client, run, consumer="launch"), client)
            for run, p in feeds
        ]

    def top_up(self) -> int:
        return sum(f.top_up() for f in self.feeders)
