"""The learner runtime every recipe shares: ranks, device, telemetry, stopping, micro-batches, HF export.

A recipe (``learner/ppo.py``, ``learner/sft.py``, ``learner/rm.py``, ``learner/dpo.py``) subclasses
:class:`Runtime` (through ``learner/online.py`` for PPO, which reads a replay buffer, or
``learner/offline_runtime.py`` for the trainers on a fixed dataset) and adds its models and one ``step``. What is
here is what none of them should have to think about (docs/design.md §4.1, docs/stages.md):

- **Ranks.** One process per rank (torchrun, or a plain ``python -m`` for one rank); every rank runs the
  same code on the same batch, and :meth:`Runtime.micro` deals each data-parallel group its share of a
  batch's rows (sorted by length, round-robin, so shares balance). A group is one rank, or with
  ``learner.sequence_parallel`` N ranks that split each row's positions (``learner/sequence_parallel.py``).
  :meth:`Runtime.all_sum` assembles per-row results.
- **Telemetry.** A null object off rank 0; the recipe replaces it on rank 0 once it knows where metrics go.
- **Stopping.** SIGTERM/SIGINT set a flag; the current step finishes, then the final checkpoint.
- **HF export.** :meth:`Runtime.save_hf` gathers the full weights (a collective under ZeRO-3) and writes a
  Hugging Face directory.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

import weightsync
from learner import lora
from learner.batch import Batch, Layout, MicroBatch, micro_batches, rank_budget
from learner.models import init_distributed, resolve_device
from learner.sequence_parallel import SequenceParallel
from tandem.config import Config
from tandem.procs import exit_with_driver
from tandem.telemetry import Telemetry, without_wandb

log = logging.getLogger("learner")


class Stats:
    """Weighted means accumulated over micro-batches and reduced over ranks once per step.

    ``add`` only records its tensors; ``reduce`` sums them per key in a few tensor ops, then one
    all-reduce. On a small model a step is dominated by per-op overhead, and summing a dozen metrics one
    by one per micro-batch cost about a tenth of the step.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.totals: list[Tensor] = []  # 1-d pieces, in the order of ``keys``
        self.weights: list[Tensor] = []

    def add(self, key: str, total: Tensor, weight: Tensor) -> None:
        self.keys.append(key)
        self.totals.append(total.detach().float().reshape(1))
        self.weights.append(weight.detach().float().reshape(1))

    def add_sums(self, prefix: str, sums: dict[str, Tensor], weight: Tensor) -> None:
        """Several sums over the same ``weight`` items, each kept as ``prefix/name``."""
        for name, total in sums.items():
            self.add(f"{prefix}/{name}", total, weight)

    def add_means(self, metrics: dict[str, Tensor], weight: Tensor) -> None:
        """Several means of the same weight (``metrics`` holds 0-d tensors)."""
        if not metrics:
            return
        weight = weight.detach().float().reshape(1)
        self.keys.extend(metrics)
        self.totals.append(torch.stack([m.detach().float() for m in metrics.values()]) * weight)
        self.weights.append(weight.expand(len(metrics)))

    def extend(self, other: Stats) -> None:
        """``other``'s records after this one's (each thread that trains keeps its own, merged here)."""
        self.keys += other.keys
        self.totals += other.totals
        self.weights += other.weights

    def reduce(self) -> dict[str, float]:
        """One all-reduce for every metric; only the keys with weight (a metric of no token is left out)."""
        keys = sorted(set(self.keys))  # the same keys on every rank: the same code ran
        if not keys:
            return {}
        totals, weights = torch.cat(self.totals), torch.cat(self.weights)
        finite = torch.isfinite(totals)  # not e.g. the explained variance of constant returns
        pos = {k: i for i, k in enumerate(keys)}
        index = torch.tensor([pos[k] for k in self.keys], device=totals.device)
        pieces = torch.stack([torch.where(finite, totals, 0.0), torch.where(finite, weights, 0.0)], 1)
        packed = torch.zeros(len(keys), 2, device=totals.device).index_add_(0, index, pieces)  # (K, 2)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        return {k: s / w for k, (s, w) in zip(keys, packed.tolist(), strict=True) if w > 0}


def grad_norm(engine: Any, role: str, stats: Stats) -> None:
    """``<role>/grad_norm``: the norm of the last step's gradient before clipping, as DeepSpeed reports it
    (at fp32 ZeRO stage 0 once :func:`learner.models.keep_clip_norm` has kept it)."""
    norm = engine.get_global_grad_norm()
    if norm is not None:
        stats.add(f"{role}/grad_norm", torch.as_tensor(float(norm)), torch.ones(()))


class Runtime:
    """One learner rank of any recipe: device, process group, telemetry, signals."""

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        self.cfg, self.run_dir, self.resume, self.layout = cfg, Path(run_dir), resume, layout
        exit_with_driver()  # started by launch.py: gone soon after it (tandem/procs.py)
        self.ckpt_dir = Path(cfg.learner.checkpoint_dir or self.run_dir / "checkpoints")
        self.device = resolve_device(cfg)
        self.ctrl = init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lead = self.rank == 0
        # learner.sequence_parallel: groups of ranks that split each row's positions (one group per rank
        # without it); the data-parallel groups deal a batch's rows between them.
        self.sp = start_sequence_parallel(cfg)
        if self.sp.size > 1 and layout == "pack":
            raise ValueError(
                "learner.sequence_parallel with --layout pack: Ulysses' sdpa attends causally over the whole "
                "gathered row, so packed sequences would see each other (docs/design.md §4.12); use --layout pad"
            )
        torch.manual_seed(cfg.run.seed + self.rank)
        self.version = 0  # optimizer-step count: PPO's policy version, the offline trainers' step
        self.checkpointed_version = -1
        self._signalled = False
        self._old_handlers: dict[int, object] = {}
        self.telemetry = Telemetry(without_wandb(cfg), f"learner-{self.rank}")  # a null object off rank 0

    @property
    def dp_world(self) -> int:
        """Data-parallel groups: the factor DeepSpeed divides the summed gradient by."""
        return self.sp.dp_world

    def require_multiple_of_ranks(self, **sizes: int) -> None:
        groups = self.sp.dp_world
        for name, size in sizes.items():
            if size % groups:
                raise ValueError(
                    f"{name} ({size}) must be a multiple of the learner's data-parallel groups ({groups}: "
                    f"learner.num_ranks / learner.sequence_parallel)"
                )

    # ------------------------------------------------------------------------------------------ stopping

    def install_signal_handlers(self) -> None:
        self._old_handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("signal %d: finishing the current step, then a final checkpoint", signum)
        self._signalled = True

    def request_stop(self) -> None:
        """Stop as a signal would: the current step finishes, then the final checkpoint."""
        self._signalled = True

    def stop_requested(self) -> bool:
        return self._signalled or self.telemetry.stop_requested()

    def any_rank_stopping(self) -> bool:
        """A stop seen on any rank stops them all (one all-reduce): ranks must run the same steps."""
        flag = torch.tensor([float(self.stop_requested())])
        if self.world > 1:
            dist.all_reduce(flag, group=self.ctrl)
        return bool(flag.item() > 0)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            if handler is not None:  # None: installed outside Python, nothing to restore
                signal.signal(sig, handler)
        self._old_handlers = {}

    # ------------------------------------------------------------------------------------------ batches

    def micro(self, batch: Batch, rows: Tensor) -> list[MicroBatch]:
        """This rank's micro-batches of ``rows``: sorted by length and dealt round-robin, so shares balance;
        ``micro_batch_size`` rows each, or by ``learner.max_tokens_per_micro_batch`` tokens.

        Every micro-batch's loss is divided by its (mini)batch's token count, so the accumulated gradient
        is the same whatever the split (docs/design.md §4.8). Under a token budget every rank computes
        every rank's split and splits its own further to the largest count: all ranks run the same number
        of passes without a message.
        """
        budget, sp = self.cfg.learner.max_tokens_per_micro_batch, self.sp
        if budget is not None:
            mine, sizes = rank_budget(batch.seq_lens, rows, budget, self.layout, sp.dp_rank, sp.dp_world)
            mbs = micro_batches(batch, mine, len(mine), self.layout, self.device, sizes=sizes)
        else:
            rows = rows[torch.argsort(batch.seq_lens[rows], descending=True, stable=True)][
                sp.dp_rank :: sp.dp_world
            ]
            mbs = micro_batches(batch, rows, self.cfg.learner.micro_batch_size, self.layout, self.device)
        return [sp.shard(mb) for mb in mbs]  # whole rows without sequence parallelism

    def all_sum(self, t: Tensor) -> Tensor:
        """Per-row results assembled: each row was filled by one data-parallel group (zeros elsewhere)."""
        return self.sp.all_sum(t)

    # ---------------------------------------------------------------------------------------- HF export

    def save_hf(self, engine: Any, out: Path, tokenizer: Any) -> None:
        """Write ``engine``'s model as a Hugging Face directory (every rank calls it: a ZeRO-3 collective).

        A LoRA model is written with its adapters merged (a plain checkpoint every engine loads), or, with
        ``learner.lora.merge_final: false``, as the adapter alone (``python -m learner.lora merge``).
        """
        module: nn.Module = engine.module
        named = weightsync.named_full_parameters(engine)  # collective under ZeRO-3
        if lora.is_lora(module) and self.cfg.learner.lora.merge_final:
            state = dict(lora.merged_tensors(module, named))
            if self.lead:
                plain = AutoModelForCausalLM.from_config(module.get_base_model().config)
                missing, unexpected = plain.load_state_dict(state, strict=False)
                if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is no tensor of its own
                    raise RuntimeError(f"merging LoRA: missing {missing[:3]}, unexpected {unexpected[:3]}")
                plain.save_pretrained(out)
        else:
            state = dict(named)
            if self.lead:
                module.save_pretrained(out, state_dict=state)
        if self.lead:
            tokenizer.save_pretrained(out)
            log.info("model (step %d) saved to %s", self.version, out)
        dist.barrier()


def start_sequence_parallel(cfg: Config) -> SequenceParallel:
    """The rank's sequence-parallel place (learner/sequence_parallel.py); the actor's heads must divide
    among ``learner.sequence_parallel`` ranks (DeepSpeed's Ulysses splits attention by heads)."""
    size = cfg.learner.sequence_parallel
    try:
        return SequenceParallel.start(size, cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as e:  # UlyssesSPAttentionHF's check of the heads
        raise ValueError(f"learner.sequence_parallel={size} does not fit {cfg.model.actor}: {e}") from e
