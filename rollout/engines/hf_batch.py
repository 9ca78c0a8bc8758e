"""The hf engine's running batch: concurrent ``generate`` calls share decode steps (continuous batching).

vLLM and SGLang add a request to the batch that is already decoding; this module does the same for the
``hf`` engine, so the turns of episodes that progress independently, agents' calls and HTTP requests are
decoded together instead of one call after another (docs/design.md §8.1). A call's rows wait in
``pending``; at the next step they are prefilled (their cached prefix reused) and join the batch, and a
finished row leaves it at once, its KV stored in the prefix cache.

One step of the whole batch (``HFEngine._step``, under the engine's lock):

1. **decode** the rows already running: one token each;
2. **admit** the pending rows: one prefill forward, which samples their first token;
3. **record** every row's token (its call's ``on_token`` too) and take out the rows that finished; a
   prompt whose ``n`` rows have all finished is reported by its own call's thread (``on_prompt``), while
   the call's other prompts still decode.

One call's thread drives the batch at a time (it holds ``driver``): it takes a step, runs its own
``between_steps`` hook outside the lock, and again, until its rows have finished; then it hands the role
to a call still in the batch. The others wait, asking their own hook every ``WAIT_POLL_S`` (a client
that is gone withdraws its rows); one that finds the driver inside its hook at that moment takes the role,
so a call held in its hook holds up nobody for long. So a weight update lands between two steps of every
row, and 32 episodes' threads do not contend for every step. Rows of one batch may sample differently (each call's
temperature, top-k/p and seed); rows that share settings and generator are sampled together.

KV layout. The cache holds ``T`` columns for every row, right-aligned: a row's real columns end at the
last one, anything left of them is padding, masked out (``mask`` (B, T)); a row's own ``[pad, cached,
pad, suffix]`` prefill layout keeps its inner padding. Joining pads the narrower side on the left; when
the longest row leaves, the columns that no row uses any more are cut off.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from rollout.engines.base import Completion, OnPrompt, OnToken, SamplingParams

WAIT_POLL_S = 0.2  # how often a call that is not driving asks its own hook whether it is still wanted


@dataclass(eq=False)
class Request:
    """One ``generate`` call: its flattened rows (``prompt × n``), how they sample, and their completions."""

    rows: list[list[int]]
    sampling: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    on_token: OnToken | None = None
    on_prompt: OnPrompt | None = None  # called by the call's own thread, with each prompt's n completions
    grammar: object | None = None  # the compiled constraint (xgrammar), each row matched on its own
    out: list[Completion] = field(default_factory=list)
    left: int = 0  # rows not finished
    prompt_left: list[int] = field(default_factory=list)  # rows not finished, per prompt
    done: list[int] = field(default_factory=list)  # prompts whose rows have all finished, not yet reported
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    # finished, handed the driver role, or (with on_prompt) a prompt is done
    wake: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.out = [Completion([], [], "length", []) for _ in self.rows]
        self.left = len(self.rows)
        self.prompt_left = [self.sampling.n] * (len(self.rows) // self.sampling.n)

    def row_done(self, row: int) -> None:
        """Row ``row`` has finished (under the engine's lock); its prompt is done with its last row."""
        prompt = row // self.sampling.n
        self.prompt_left[prompt] -= 1
        if not self.prompt_left[prompt]:
            self.done.append(prompt)
            if self.on_prompt is not None:
                self.wake.set()  # its own thread reports it, even while another call's thread drives
        self.left -= 1
        if not self.left:
            self.finish()

    def prompt_completions(self, prompt: int) -> list[Completion]:
        n = self.sampling.n
        return self.out[prompt * n : (prompt + 1) * n]

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished.set()
        self.wake.set()

    def sampling_key(self) -> tuple[object, ...]:
        s = self.sampling
        return (id(self.generator), s.temperature, s.top_p, s.top_k)


@dataclass(eq=False)
class Entry:
    """One row in the batch: which call and row it is, and what storing its KV needs."""

    request: Request
    row: int
    hashes: list[int]  # the row's prefix hashes (empty without a prefix cache)
    epoch: int  # the prefix cache's epoch when the row was prefilled
    matcher: Any = None  # the row's xgrammar GrammarMatcher when its call is constrained
    routing: list[Any] = field(default_factory=list)  # (t, layers, k) arrays per forward, when recorded

    @property
    def completion(self) -> Completion:
        return self.request.out[self.row]


class RunningBatch:
    """The rows decoding now and the rows waiting to join; every method is called under the engine's lock."""

    def __init__(self) -> None:
        self.pending: list[Entry] = []
        self.entries: list[Entry] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # (B, T) real columns of the cache
        self.positions = torch.zeros((0, 1), dtype=torch.long)  # (B, 1) position of each row's last fed token
        self.next_ids = torch.zeros((0, 1), dtype=torch.long)  # (B, 1) each row's last sampled token
        self.padded = False  # any masked column: no row is padded -> plain causal attention
        self.driver: Request | None = None  # the call whose thread takes the steps
        self.hooked: Request | None = None  # a driver inside its between_steps hook

    def __len__(self) -> int:
        return len(self.entries)

    def kv_nbytes(self) -> int:
        if self.cache is None:
            return 0
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)

    # ------------------------------------------------------------------------------------------ members

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, DynamicCache]:
        """The next decode step's ids (B, 1), mask (B, T + 1) or None, positions (B, 1) and cache."""
        assert self.cache is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.entries), 1)], dim=-1)
        self.positions = self.positions + 1
        return self.next_ids, self.mask if self.padded else None, self.positions, self.cache

    def join(
        self,
        entries: list[Entry],
        cache: DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        next_ids: torch.Tensor,
    ) -> None:
        """Add prefilled rows: their cache and mask (n, T'), last fed positions (n, 1), sampled ids (n, 1)."""
        if not self.entries:
            self.entries, self.cache, self.mask = list(entries), cache, mask
            self.positions, self.next_ids = positions, next_ids
        else:
            assert self.cache is not None
            width = max(self.mask.shape[1], mask.shape[1])
            for old, new in zip(self.cache.layers, cache.layers, strict=True):
                old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
                old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)])
            self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
            self.positions = torch.cat([self.positions, positions])
            self.next_ids = torch.cat([self.next_ids, next_ids])
            self.entries += entries
        self.padded = not bool(self.mask.all())

    def keep(self, keep: list[int]) -> None:
        """Keep only batch entries ``keep`` (indices, in order), and cut the columns no row uses now."""
        if len(keep) == len(self.entries):
            return
        if not keep:  # empty: drop the cache
            self.cache, self.entries, self.padded = None, [], False
            self.mask, self.positions, self.next_ids = (
                self.mask[:0, :0],
                self.positions[:0],
                self.next_ids[:0],
            )
            return
        assert self.cache is not None
        idx = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.positions, self.next_ids = self.mask[idx], self.positions[idx], self.next_ids[idx]
        self.entries = [self.entries[j] for j in keep]
        unused = int(self.mask.any(0).int().argmax())  # leading columns every row masks
        if unused:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
            self.mask = self.mask[:, unused:]
        self.padded = not bool(self.mask.all())

    def withdraw(self, request: Request) -> None:
        """Take ``request``'s rows out, waiting or running (its caller is gone)."""
        self.pending = [e for e in self.pending if e.request is not request]
        self.keep([j for j, e in enumerate(self.entries) if e.request is not request])

    def fail_all(self, error: BaseException) -> None:
        """A step failed: the batch's state is unknown, so every call in it hears of it and it starts empty."""
        for e in [*self.entries, *self.pending]:
            e.request.finish(error)
        driver = self.driver
        self.__init__()  # type: ignore[misc]
        self.driver = driver  # its thread is unwinding and hands the role on

    # ------------------------------------------------------------------------------------------- driver

    def take_wheel(self, request: Request) -> bool:
        """Whether ``request``'s thread drives now (it takes the role when nobody holds it)."""
        if self.driver is None:
            self.driver = request
        return self.driver is request

    def take_over(self, request: Request) -> None:
        """A waiting call's poll: the role is ``request``'s if the driver is inside its hook right now."""
        if self.driver is not None and self.hooked is self.driver:
            self.driver = request

    def hand_off(self, request: Request) -> None:
        """``request`` is done driving: the role goes to a call still in the batch, whose thread is woken."""
        if self.driver is not request:
            return
        self.driver = next(
            (e.request for e in [*self.entries, *self.pending] if not e.request.finished.is_set()), None
        )
        if self.driver is not None:
            self.driver.wake.set()


def sample_groups(entries: list[Entry]) -> list[list[int]]:
    """Batch indices of the rows that sample alike (same settings and generator), first seen first."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for j, e in enumerate(entries):
        groups.setdefault(e.request.sampling_key(), []).append(j)
    return list(groups.values())


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros added on the left of ``dim`` up to ``width``."""
    short = width - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)
