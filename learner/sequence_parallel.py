"""Ulysses sequence parallelism in the learner (``learner.sequence_parallel``, docs/design.md §4.12).

``N = learner.sequence_parallel`` consecutive ranks form a group that trains one micro-batch together,
each rank holding ``1/N`` of every row's positions; the ``num_ranks / N`` groups split a batch's rows
between them as ranks do without sequence parallelism. How it goes, micro-batch by micro-batch:

1. **Shard.** :meth:`SequenceParallel.shard` pads the micro-batch's rows to a multiple of ``N`` positions
   (right padding, exact under a causal mask) and keeps this rank's slice of ``input_ids``, with explicit
   position ids: the attention needs them to rebuild the whole sequence.
2. **Attend.** Every model's ``sdpa`` attention is DeepSpeed's ``UlyssesSPAttentionHF``: an all-to-all
   trades the sequence shard for a head shard, attention runs over the whole sequence, a second all-to-all
   trades back. Embeddings, MLPs, norms and the head work per position on the shard.
3. **Assemble.** A rank computes the response tokens that fall in its slice (the chunked head's
   log-probabilities, the critic's values) and leaves the others 0; :func:`assemble` sums
   the group's ``(b, R)`` pieces, so every rank of the group holds the whole micro-batch's numbers and
   computes the same loss. The sum's backward keeps each rank's gradient to its own slice (the others'
   come from their ranks); the engines, built with :func:`mpu`, add the group's gradients together.

One rank (``N = 1``) is the same code with a group of one: nothing is padded, sharded or summed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from torch import Tensor
from transformers import AutoConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from learner.batch import MicroBatch

ATTENTION = "sdpa"  # the attention Ulysses wraps on CPU; flash kernels (GPU) would also take packed rows


@dataclass(frozen=True)
class Shard:
    """A sharded micro-batch's slice on this rank: positions ``[start, start + length)`` of every row."""

    start: int
    length: int
    group: dist.ProcessGroup  # the sequence-parallel group holding the other slices


def assemble(local: Tensor, shard: Shard) -> Tensor:
    """The group's sum of ``local`` (each rank's own tokens, 0 elsewhere): the whole micro-batch's values
    on every rank, with gradient flowing to ``local`` alone.

    Every rank of the group then computes the same loss, so its gradient with respect to the sum is the
    same on each; passing it back to the local piece only (where an all-reduce's backward would sum it
    over the group) counts each token's gradient once. DeepSpeed's ``_global_sp_sum``
    (deepspeed/sequence/cross_entropy.py) is the same construction."""
    total = local.detach().clone()
    dist.all_reduce(total, group=shard.group)
    return local + (total - local.detach())


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the sequence-parallel and data-parallel groups."""

    size: int  # N: ranks per sequence
    rank: int  # this rank within its sequence-parallel group
    group: dist.ProcessGroup | None  # the sequence-parallel group (None: N = 1)
    dp_rank: int  # this rank's group among the data-parallel groups: which rows it trains
    dp_world: int  # num_ranks / N
    dp_group: dist.ProcessGroup | None  # the ranks of every group holding this rank's slice

    @classmethod
    def start(cls, size: int, model: str, *, trust_remote_code: bool = False) -> SequenceParallel:
        """Build the groups and route every ``sdpa`` attention through Ulysses (process-wide, so the
        reference, critic and teacher forwards are sharded too); ``model``'s heads size the all-to-alls."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if size == 1:
            return cls(1, 0, None, rank, world, dist.group.WORLD)
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=size)
        dp_group = None
        for first in range(size):  # every rank joins every new_group call, in the same order
            group = dist.new_group(list(range(first, world, size)))
            if rank % size == first:
                dp_group = group
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).get_text_config()
        _route_attention(config, parallel_state_sp.get_sequence_parallel_group())
        return cls(
            size,
            parallel_state_sp.get_sequence_parallel_rank(),
            parallel_state_sp.get_sequence_parallel_group(),
            rank // size,
            world // size,
            dp_group,
        )

    def shard(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` (the ``pad`` layout) with this rank's slice of every row's positions; its
        response-aligned fields stay whole."""
        if self.size == 1:
            return mb
        if mb.position_ids is not None or mb.routed is not None or mb.vision is not None:
            raise ValueError("learner.sequence_parallel shards padded text rows only")
        rows, length = mb.input_ids.shape
        padded = -(-length // self.size) * self.size
        ids = torch.nn.functional.pad(mb.input_ids, (0, padded - length))
        positions = torch.arange(padded, device=ids.device).expand(rows, padded)
        n = padded // self.size
        cut = slice(self.rank * n, (self.rank + 1) * n)
        return replace(
            mb,
            input_ids=ids[:, cut].contiguous(),
            position_ids=positions[:, cut].contiguous(),
            shard=Shard(self.rank * n, n, self.group),
        )

    def all_sum(self, t: Tensor) -> Tensor:
        """Sum over the data-parallel groups (one rank of each sequence-parallel group): assembles per-row
        results that each group filled for its own rows."""
        if self.dp_world > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t


def check_models(models: dict[str, torch.nn.Module], actor: torch.nn.Module) -> None:
    """Every model of the learner (by role) attends through the Ulysses-wrapped ``sdpa``, with the actor's
    heads, which sized the all-to-alls. Raises ``ValueError`` naming the role."""
    want = _heads(_text_config(actor))
    for role, model in models.items():
        config = _text_config(model)
        attention = getattr(config, "_attn_implementation", None)
        if attention != ATTENTION:
            raise ValueError(
                f"learner.sequence_parallel: the {role} attends with {attention!r}; Ulysses wraps "
                f"{ATTENTION!r} only (on CPU; flash kernels need a GPU)"
            )
        if _heads(config) != want:
            raise ValueError(
                f"learner.sequence_parallel: the {role}'s attention heads {_heads(config)} differ from the "
                f"actor's {want}, which size the sequence-parallel all-to-alls"
            )


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None) or model.seq_cls.config  # a critic is a ValueModel
    return config.get_text_config()


def _heads(config: Any) -> tuple[int, int, int]:
    """Query heads, KV heads and head size."""
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def mpu() -> Any:
    """DeepSpeed's sequence-parallel state, for ``deepspeed.initialize(mpu=...)``: engines then reduce
    gradients over the sequence-parallel and data-parallel ranks together, summing a group's shards."""
    return parallel_state_sp


def _route_attention(config: Any, group: dist.ProcessGroup) -> None:
    """Put Ulysses in front of transformers' ``sdpa`` attention, one ``UlyssesSPAttentionHF`` per row count.

    DeepSpeed's ``register_with_transformers`` fixes the micro-batch's row count when it registers, but a
    learner's micro-batches vary (the last of a batch, a token budget's); the wrapper below keeps one
    instance per row count and otherwise does what DeepSpeed's does: it drops the 4-D mask built for the
    shard (causal attention over the gathered sequence is exact for right-padded rows)."""
    core = ALL_ATTENTION_FUNCTIONS[ATTENTION]
    heads, kv_heads, head_size = _heads(config)
    by_rows: dict[int, UlyssesSPAttentionHF] = {}

    def attend(rows: int) -> UlyssesSPAttentionHF:
        if rows not in by_rows:
            by_rows[rows] = UlyssesSPAttentionHF(
                attn=core,
                batch_size=rows,
                attn_head_count=heads,
                attn_head_size=head_size,
                kv_head_count=kv_heads,
                num_hidden_layers=config.num_hidden_layers,
                process_group=group,
                seq_length_is_variable=True,
            )
        return by_rows[rows]

    attend(1)  # its constructor checks the heads against N now, not at the first forward

    def ulysses(
        module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, *args: Any, **kw: Any
    ) -> tuple[Tensor, Tensor | None]:
        return attend(query.shape[0])(module, query, key, value, None, *args, **kw)

    ALL_ATTENTION_FUNCTIONS[ATTENTION] = ulysses
