"""Trajectories to tensors: the learner's batch, its micro-batches, and its wire form between ranks.

A :class:`Batch` holds one learner step's trajectories as response-aligned tensors ``(B, R)`` (the layout
``learner/advantages.py`` and ``learner/losses.py`` expect: right-padded, ``mask`` 1 on real tokens).
Forward passes do not run on that layout; they run on :class:`MicroBatch` es built from a subset of rows.

Layout of a forward pass (both exact; neither computes on padding that can reach a real token):

- ``pad`` (default): rows right-padded to the micro-batch's longest member, with *no* attention mask:
  under a causal mask a real token never attends to the padding after it, so the result is exact and the
  fast ``is_causal`` attention path stays on. Rows are sorted by length first, so little padding remains.
- ``pack``: the micro-batch's sequences concatenated into one row ``(1, N)`` with position ids restarting
  at 0 for each; transformers turns restarting position ids (and no attention mask) into a block-diagonal
  causal mask. No padding at all, but on CPU the dense ``(N, N)`` mask path is ~9x slower than ``pad``
  (``bench/learner.py``: 690 vs 6,500 tokens/s on a 4-layer tiny model); worth it only with a varlen
  (flash-attention) kernel on GPU.

Either way, response token ``j`` of sequence ``i`` is predicted by the logits at ``(row_i, start_i + j)``
with ``start_i = offset_i + P_i − 1``; :func:`response_view` gathers those positions back into ``(b, R)``.

Aborted responses (``finish_reason == "abort"``) were cut by a pause, so their reward judges a truncated
answer: their tokens are masked (no gradient, no statistics) and each forms a group of its own, so it
cannot move the group baseline of its siblings. They stay in the batch to keep every rank's shapes equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from buffer.schema import Trajectory, decode_trajectory, encode_trajectory, value_range
from learner.sequence_parallel import Shard, assemble
from tandem.vision import VisionInputs, mm_token_type_ids, placeholder_ids

Layout = Literal["pack", "pad"]


@dataclass
class Batch:
    """One learner step's trajectories. Per-token tensors are over response tokens: ``(B, R)``."""

    trajs: list[Trajectory]
    behav_logp: Tensor  # (B, R) float32, 0 on padding
    mask: Tensor  # (B, R) float32, 1 on trained tokens (generated, not aborted), 0 on env tokens and padding
    rewards: Tensor  # (B,) float32
    group_index: Tensor  # (B,) int64; aborted rows get a label of their own
    staleness: Tensor  # (B,) int64, at the learner version that trains on the batch
    seq_lens: Tensor  # (B,) int64, prompt + response
    turn_rewards: Tensor | None = None  # (B, R) float32: each turn's reward on its last generated token
    dropped: Tensor | None = None  # (B,) bool: over the token budget, masked out (make_batch's max_tokens)
    ref_logp: Tensor | None = None  # (B, R) float32: the servers' reference scores, when every row has them
    # (B,) float32: 1/k on each of an agent episode's k segments, so group statistics count episodes (§10.6)
    episode_weight: Tensor | None = None

    def __len__(self) -> int:
        return len(self.trajs)

    def to(self, device: torch.device) -> Batch:
        """Per-token tensors and rewards on ``device``; row bookkeeping (lengths, staleness) stays on CPU."""
        return replace(
            self,
            behav_logp=self.behav_logp.to(device),
            mask=self.mask.to(device),
            rewards=self.rewards.to(device),
            group_index=self.group_index.to(device),
            episode_weight=None if self.episode_weight is None else self.episode_weight.to(device),
            turn_rewards=None if self.turn_rewards is None else self.turn_rewards.to(device),
            ref_logp=None if self.ref_logp is None else self.ref_logp.to(device),
        )

    @property
    def num_tokens(self) -> int:
        """Tokens a forward pass reads (prompts and responses): the unit of ``throughput/*``."""
        return int(self.seq_lens.sum())


def trajectory_problem(
    t: Trajectory, vocab_size: int, routing: tuple[int, int, int] | None = None
) -> str | None:
    """Why a well-formed trajectory cannot be trained on by this model, or None.

    The schema checks what any consumer needs; this checks what only the learner knows (its vocabulary,
    and with ``routing`` its MoE routers' (layers, k, experts)): an out-of-range id would otherwise fail
    inside the embedding, on every retry after a restart; so would recorded routing of another model.
    """
    for name, ids in (("prompt_tokens", t.prompt_tokens), ("response_tokens", t.response_tokens)):
        if len(ids) and (hi := value_range(ids)[1]) >= vocab_size:
            return f"{name}: token id {hi} outside the model's vocabulary of {vocab_size}"
    r = t.routed_experts
    if r is not None and routing is not None:
        layers, k, experts = routing
        if r.shape[1:] != (layers, k):
            return f"routed_experts: (layers, k) {r.shape[1:]}, the model's routers have {(layers, k)}"
        if r.size and int(r.max()) >= experts:
            return f"routed_experts: expert {int(r.max())} outside the model's {experts}"
    return None


def make_batch(
    trajs: Sequence[Trajectory], version: int, *, per_turn: bool = False, max_tokens: int | None = None
) -> Batch:
    """Collate trajectories (on CPU; tensors move to the device per micro-batch). ``per_turn`` places the
    turn rewards an episode recorded (``meta["turn_credit"]``: last generated token, reward) on their
    tokens; a trajectory without them keeps its sequence reward.

    A trajectory longer than ``max_tokens`` (prompt + response; the token budget of a forward pass) is
    dropped as an aborted one is, masked out and a group of its own, and its forward passes read one
    token instead of it (``Batch.dropped``; docs/design.md §4.8). ``Batch.ref_logp`` holds the rollout
    servers' reference log-probabilities when every trajectory carries them (``placement.reference: server``).
    """
    width = max([1, *(len(t.response_tokens) for t in trajs)])
    b = len(trajs)
    lens = np.array([len(t.prompt_tokens) + len(t.response_tokens) for t in trajs], dtype=np.int64)
    dropped = lens > max_tokens if max_tokens is not None else np.zeros(b, dtype=bool)
    # Filled in numpy, then wrapped: a numpy slice assignment costs a fraction of a torch one per row.
    behav = np.zeros((b, width), dtype=np.float32)
    mask = np.zeros((b, width), dtype=np.float32)
    groups: dict[str, int] = {}
    group_index = np.empty(b, dtype=np.int64)
    for i, t in enumerate(trajs):
        r = len(t.response_tokens)
        behav[i, :r] = t.behav_logp
        aborted = t.finish_reason == "abort" or dropped[i]
        # Environment tokens of a multi-turn episode are context: out of the loss, KL, entropy and value
        # targets, all of which read this mask (docs/environments.md §10.1).
        mask[i, :r] = 0.0 if aborted else t.loss_mask
        group_index[i] = -1 - i if aborted else groups.setdefault(t.group_id, len(groups))
    # placement.reference: server: the servers scored the reference (all rows or none are usable).
    ref = np.zeros((b, width), dtype=np.float32) if all(t.ref_logp is not None for t in trajs) else None
    for i, t in enumerate(trajs if ref is not None else ()):
        ref[i, : len(t.response_tokens)] = t.ref_logp
    turns = np.zeros((b, width), dtype=np.float32) if per_turn else None
    for i, t in enumerate(trajs if per_turn else ()):
        for pos, reward in t.meta.get("turn_credit") or ():
            turns[i, pos] += reward
    return Batch(
        trajs=list(trajs),
        behav_logp=torch.from_numpy(behav),
        mask=torch.from_numpy(mask),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        group_index=torch.from_numpy(group_index),
        episode_weight=torch.tensor([1.0 / t.meta.get("segments", 1) for t in trajs], dtype=torch.float32),
        staleness=torch.tensor([t.staleness(version) for t in trajs], dtype=torch.long),
        seq_lens=torch.from_numpy(np.where(dropped, 1, lens)),  # what a forward pass reads
        turn_rewards=None if turns is None else torch.from_numpy(turns),
        dropped=torch.from_numpy(dropped),
        ref_logp=None if ref is None else torch.from_numpy(ref),
    )


@dataclass
class MicroBatch:
    """Model inputs for a subset of a batch's rows, and where each row's response logits are."""

    rows: Tensor  # (b,) indices into the Batch
    input_ids: Tensor  # (1, N) packed or (b, L) padded
    position_ids: Tensor | None  # (1, N) restarting per sequence when packed; None when padded
    targets: Tensor  # (b, R) next-token labels of the response, 0 on padding
    logit_row: Tensor  # (b,) row of input_ids holding sequence i
    logit_start: Tensor  # (b,) column whose logits predict response token 0 of sequence i
    # (rows * N, layers, k) int64: the engine's routing of every input position in the order the routers see
    # them (input_ids flattened), -1 where none was recorded (padding, the last token); None: none recorded
    routed: Tensor | None = None
    # A vision-language model's image inputs for the rows that have images (:func:`with_vision`): passed to
    # the forward as keyword arguments. None for a text-only micro-batch.
    vision: dict[str, Tensor] | None = None
    suppress: Tensor | None = None  # (k,) a vision-language policy's placeholder ids: never sampled
    # learner.sequence_parallel: input_ids and position_ids hold this rank's slice of every row's positions
    # (learner/sequence_parallel.py); the response-aligned fields stay whole. None: whole rows.
    shard: Shard | None = None


def with_vision(mb: MicroBatch, images: Sequence[VisionInputs | None], config: Any) -> MicroBatch:
    """``mb`` for a vision-language model (``config``, its config): its rows' image inputs (``images[k]``
    for row ``k`` of the micro-batch, None for a row without images) as pixel values and grid sizes in row
    order with the image-token types Qwen2-VL computes its 3-D positions from, and the placeholder ids the
    policy never samples (every row, images or not: the engine masks them for every prompt).

    Only the ``pad`` layout: the model computes the 3-D positions per row itself, where packed rows would
    need them restarting per sequence, which nothing builds yet."""
    if mb.position_ids is not None:
        raise ValueError("image inputs need learner.layout pad (packed rows have no 3-D positions yet)")
    if len(images) != len(mb.rows):
        raise ValueError(f"{len(images)} image inputs for a micro-batch of {len(mb.rows)} rows")
    device = mb.input_ids.device
    mb = replace(mb, suppress=torch.tensor(placeholder_ids(config), dtype=torch.long, device=device))
    present = [v for v in images if v is not None]
    if not present:
        return mb
    vision = VisionInputs.concat(present).to(device)
    return replace(
        mb,
        vision={
            "pixel_values": vision.pixel_values,
            "image_grid_thw": vision.image_grid_thw,
            "mm_token_type_ids": mm_token_type_ids(mb.input_ids, int(config.image_token_id)),
        },
    )


def with_row_vision(mbs: list[MicroBatch], batch: Batch, config: Any) -> list[MicroBatch]:
    """:func:`with_vision` for each micro-batch of ``batch``, its rows' images read from their trajectories
    (``pixel_values``, ``image_grid_thw``); a row dropped over the token budget reads no image."""
    dropped = batch.dropped
    return [
        with_vision(
            mb,
            [
                None if dropped is not None and dropped[r] else VisionInputs.of(batch.trajs[r])
                for r in mb.rows.tolist()
            ],
            config,
        )
        for mb in mbs
    ]


def micro_batches(
    batch: Batch,
    rows: Tensor,
    size: int,
    layout: Layout,
    device: torch.device,
    *,
    sizes: Sequence[int] | None = None,
) -> list[MicroBatch]:
    """Split ``rows`` into micro-batches of ``size`` rows, or of ``sizes[k]`` rows each (a token budget,
    :func:`budget_sizes`); rows are sorted by length first (less padding)."""
    rows = rows[torch.argsort(batch.seq_lens[rows], descending=True, stable=True)]
    if sizes is None:
        return [_build(batch, rows[i : i + size], layout, device) for i in range(0, len(rows), size)]
    if sum(sizes) != len(rows):
        raise ValueError(f"micro-batch sizes {list(sizes)} do not add up to {len(rows)} rows")
    bounds = np.cumsum([0, *sizes]).tolist()
    return [_build(batch, rows[a:b], layout, device) for a, b in pairwise(bounds)]


def budget_sizes(
    lens: Sequence[int], max_tokens: int, layout: Layout, *, rows_per_unit: int = 1
) -> list[int]:
    """Units per micro-batch of units sorted longest first, so that no forward pass reads more than
    ``max_tokens`` tokens: rows x longest when padded, the sum of lengths when packed. A unit is one
    sequence, or ``rows_per_unit`` sequences that share a pass (a preference pair; ``lens`` is then its
    longest sequence when padded, its total when packed). Short units share a pass, a long one gets a pass
    of its own (alone, even above the budget: callers keep units within it, docs/design.md §4.8)."""
    sizes: list[int] = []
    start = 0
    while start < len(lens):
        n, packed = 1, lens[start]
        while start + n < len(lens):
            packed += lens[start + n]
            if ((n + 1) * rows_per_unit * lens[start] if layout == "pad" else packed) > max_tokens:
                break
            n += 1
        sizes.append(n)
        start += n
    return sizes


def rank_budget(
    lens: Tensor,
    units: Tensor,
    max_tokens: int,
    layout: Layout,
    rank: int,
    world: int,
    *,
    rows_per_unit: int = 1,
) -> tuple[Tensor, list[int]]:
    """This rank's share of ``units`` (longest first) and its micro-batch sizes under a token budget.

    Shares are dealt round-robin over the length-sorted units (as ``Runtime.micro`` deals rows). Every
    rank holds the whole batch, so each computes every rank's split and halves its own largest
    micro-batches up to the largest count (:func:`split_to`): all ranks run the same number of forward
    passes, which ZeRO-3 needs, without a message.

    Shape: lens (U,) per unit, units (u,) indices into it -> (share,) indices, sizes summing to share.
    """
    ordered = units[torch.argsort(lens[units], descending=True, stable=True)]
    shares = [ordered[r::world] for r in range(world)]
    counts = [
        len(budget_sizes(lens[s].tolist(), max_tokens, layout, rows_per_unit=rows_per_unit)) for s in shares
    ]
    mine = shares[rank]
    sizes = budget_sizes(lens[mine].tolist(), max_tokens, layout, rows_per_unit=rows_per_unit)
    return mine, split_to(sizes, max(counts))


def pair_micro_batches(
    batch: Batch,
    rank: int,
    world: int,
    layout: Layout,
    device: torch.device,
    *,
    size: int,
    budget: int | None,
) -> list[MicroBatch]:
    """This rank's micro-batches of a batch of pairs (row ``i`` and row ``i + b`` are pair ``i``'s two
    sequences), each holding both sequences of whole pairs: ``size`` pairs, or as many as fit ``budget``
    tokens (``learner.max_tokens_per_micro_batch``). The rm and dpo losses need both of a pair in one pass."""
    b = len(batch) // 2
    first, second = batch.seq_lens[:b], batch.seq_lens[b:]
    if budget is None:
        mine = torch.argsort(first + second, descending=True, stable=True)[rank::world]
        chunks = mine.split(size)
    else:
        lens = torch.maximum(first, second) if layout == "pad" else first + second
        mine, sizes = rank_budget(lens, torch.arange(b), budget, layout, rank, world, rows_per_unit=2)
        chunks = mine.split(sizes)
    out = []
    for chunk in chunks:
        rows = torch.cat([chunk, chunk + b])
        out += micro_batches(batch, rows, len(rows), layout, device)
    return out


def split_to(sizes: Sequence[int], count: int) -> list[int]:
    """``sizes`` with its largest micro-batch halved until there are ``count`` (or all have one row).

    Every rank must run the same number of forward passes (ZeRO-3 gathers weights in each); a half of a
    length-sorted micro-batch stays within its token budget.
    """
    out = list(sizes)
    while len(out) < count and max(out, default=1) > 1:
        i = max(range(len(out)), key=out.__getitem__)
        out[i : i + 1] = [out[i] - out[i] // 2, out[i] // 2]
    return out


def _build(batch: Batch, rows: Tensor, layout: Layout, device: torch.device) -> MicroBatch:
    trajs = [batch.trajs[i] for i in rows.tolist()]
    dropped = [False] * len(trajs) if batch.dropped is None else batch.dropped[rows].tolist()
    # A dropped row is masked out: its pass reads its first token only, never its whole length.
    seqs = [np.concatenate([t.prompt_tokens, t.response_tokens]) for t in trajs]
    seqs = [s[:1] if d else s for s, d in zip(seqs, dropped, strict=True)]
    prompt_lens = torch.tensor(
        [1 if d else len(t.prompt_tokens) for t, d in zip(trajs, dropped, strict=True)]
    )
    targets = np.zeros((len(trajs), batch.mask.shape[1]), dtype=np.int64)
    for k, t in enumerate(trajs):
        if not dropped[k]:
            targets[k, : len(t.response_tokens)] = t.response_tokens
    lens = torch.tensor([len(s) for s in seqs])
    if layout == "pack":
        input_ids = torch.from_numpy(np.concatenate(seqs).astype(np.int64))[None]  # (1, N)
        position_ids = torch.from_numpy(np.concatenate([np.arange(len(s)) for s in seqs]))[None]  # (1, N)
        offsets = torch.cumsum(lens, 0) - lens
        logit_row, logit_start = torch.zeros_like(lens), offsets + prompt_lens - 1
    else:
        padded = np.zeros((len(seqs), int(lens.max())), dtype=np.int64)  # (b, L)
        for k, seq in enumerate(seqs):
            padded[k, : len(seq)] = seq
        input_ids, position_ids = torch.from_numpy(padded), None
        logit_row, logit_start = torch.arange(len(seqs)), prompt_lens - 1
    routed = _routed(trajs, lens, input_ids.numel(), None if layout == "pack" else input_ids.shape[1])
    return MicroBatch(
        rows=rows,
        input_ids=input_ids.to(device),
        position_ids=None if position_ids is None else position_ids.to(device),
        targets=torch.from_numpy(targets).to(device),
        logit_row=logit_row.to(device),
        logit_start=logit_start.to(device),
        routed=None if routed is None else routed.to(device),
    )


def _routed(trajs: list[Trajectory], lens: Tensor, total: int, width: int | None) -> Tensor | None:
    """The micro-batch's recorded routing, laid out as its ``input_ids`` flattened (``MicroBatch.routed``):
    sequence ``i`` starts at ``i * width`` when padded, after the previous sequences when packed (``width``
    None); positions it was not recorded for are -1. None when no trajectory carries any."""
    recorded = [t.routed_experts for t in trajs]
    first = next((r for r in recorded if r is not None), None)
    if first is None:
        return None
    out = np.full((total, *first.shape[1:]), -1, dtype=np.int64)
    start = 0
    for r, n in zip(recorded, lens.tolist(), strict=True):
        if r is not None:
            m = min(n, len(r))  # a dropped row reads its first token only
            out[start : start + m] = r[:m]
        start += n if width is None else width
    return torch.from_numpy(out)


def response_view(per_position: Tensor, mb: MicroBatch) -> Tensor:
    """Gather the response positions of every sequence out of a forward pass's output; of a sharded
    micro-batch, every rank's positions, assembled over its sequence-parallel group.

    Positions past a sequence's end are clamped to a valid column; the caller's mask zeroes them.

    Shape: per_position (rows, N, ...) -> (b, R, ...), N this rank's positions.
    """
    return assemble_response(*local_response_view(per_position, mb), mb)


def local_response_view(per_position: Tensor, mb: MicroBatch) -> tuple[Tensor, Tensor | None]:
    """:func:`response_view` before assembly: this rank's response positions (clamped elsewhere) and which
    response tokens are this rank's (None for whole rows: all). Shape: (b, R, ...), (b, R)."""
    cols, mine = response_columns(mb, per_position.shape[1])
    return per_position[mb.logit_row[:, None], cols], mine


def assemble_response(local: Tensor, mine: Tensor | None, mb: MicroBatch) -> Tensor:
    """A response-aligned result computed from :func:`local_response_view`: as is for whole rows, else
    each rank's own tokens summed over the sequence-parallel group. Shape: (b, R, ...) -> (b, R, ...)."""
    if mine is None:
        return local
    mine = mine.reshape(*mine.shape, *[1] * (local.dim() - 2))
    return assemble(torch.where(mine, local, 0.0), mb.shard)


def response_columns(mb: MicroBatch, width: int) -> tuple[Tensor, Tensor | None]:
    """The column of this rank's ``width`` positions whose output predicts each response token, clamped
    into them, and for a sharded micro-batch which response tokens fall in its slice (None: all; the
    clamped ones past a sequence's end are the caller's mask's). Shape: (b, R) each."""
    cols = mb.logit_start[:, None] + torch.arange(mb.targets.shape[1], device=mb.targets.device)
    if mb.shard is None:
        return cols.clamp(max=width - 1), None
    cols = cols - mb.shard.start
    mine = (cols >= 0) & (cols < mb.shard.length)
    return cols.clamp(0, mb.shard.length - 1), mine


# ------------------------------------------------------------------------------------- wire between ranks


def encode_batch(trajs: Sequence[Trajectory]) -> Tensor:
    """Trajectories as one uint8 tensor (length-prefixed msgpack records; never pickle) for a broadcast."""
    blobs = [encode_trajectory(t) for t in trajs]
    header = np.array([len(blobs), *map(len, blobs)], dtype="<i8").tobytes()
    return torch.frombuffer(bytearray(header + b"".join(blobs)), dtype=torch.uint8)


def decode_batch(data: Tensor) -> list[Trajectory]:
    raw = data.numpy().tobytes()
    n = int(np.frombuffer(raw[:8], dtype="<i8")[0])
    sizes = np.frombuffer(raw[8 : 8 * (n + 1)], dtype="<i8")
    trajs, pos = [], 8 * (n + 1)
    for size in sizes.tolist():
        trajs.append(decode_trajectory(raw[pos : pos + size]))
        pos += size
    return trajs
