"""The prompt set and the feeder that keeps ``{run}:prompts`` topped up (docs/design.md §1.2)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis

from tandem.config import Config, ConfigError


@dataclass
class PromptSet:
    """The dataset's records and their token ids, checked against ``data.max_prompt_tokens`` up front."""

    records: list[dict]
    tokens: list[list[int]]

    @classmethod
    def load(cls, cfg: Config) -> PromptSet:
        """Raises ConfigError naming the record and field, before any process starts."""
        from transformers import AutoTokenizer

        from tandem.data import DatasetError, load_prompts, prompt_token_ids

        d = cfg.data
        try:
            records = load_prompts(d.prompts, d.prompt_field)
        except DatasetError as e:
            raise ConfigError(f"data.prompts: {e}") from None
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        )
        if d.chat_template and not tokenizer.chat_template:
            raise ConfigError(f"data.chat_template: the tokenizer of {cfg.model.actor} has no chat template")
        tokens = []
        for rec in records:
            ids = prompt_token_ids(tokenizer, rec[d.prompt_field], chat_template=d.chat_template)
            if len(ids) > d.max_prompt_tokens:
                raise ConfigError(
                    f"data.max_prompt_tokens: record {rec['id']} of {d.prompts} has {len(ids)} tokens"
                    f" > {d.max_prompt_tokens}"
                )
            tokens.append(ids)
        return cls(records, tokens)


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
