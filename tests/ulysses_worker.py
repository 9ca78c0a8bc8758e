"""One rank of the Ulysses sequence-parallel check (tests/test_sequence_parallel.py), run by torch.distributed.run.

Every rank first computes the reference on the whole sequence without sequence parallelism, then
DeepSpeed's Ulysses attention is registered (it replaces the ``sdpa`` entry of transformers' attention
table for the whole process, so the reference has to come first), DeepSpeed's data-loader adapter shards
the same batch by sequence, and each rank runs its shard. Rank 0 writes both results as JSON.

Usage, from the repository root: ``python -m torch.distributed.run --nproc-per-node 2 -m tests.ulysses_worker
MODEL OUT.json [--swap-shards] [--packed]``. ``--swap-shards`` gives each rank its neighbour's shard (a wrong
shard order the check must catch); ``--packed`` packs the two rows into one with restarting position ids
(the ``pack`` layout, which Ulysses under ``sdpa`` gets wrong: docs/design.md §4.12).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from learner.models import init_distributed

SP = 2


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) at every position whose label is not -100; 0 elsewhere. Shape: (b, n)."""
    logp = torch.log_softmax(logits.float(), -1)
    valid = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, 0.0)


def loss_of(logp: Tensor, total: int) -> Tensor:
    """A loss with a different weight per position, so a shard mix-up changes the gradient too."""
    weights = torch.linspace(0.5, 1.5, logp.shape[-1], dtype=logp.dtype)
    return -(logp * weights).sum() / total


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def batch() -> dict[str, Tensor]:
    """Two right-padded rows of 13 real tokens at most, padded to 16 (a multiple of SP) as the learner's
    ``pad`` layout does: position ids run on through the padding, whose labels are -100."""
    g = torch.Generator().manual_seed(0)
    n, lens = 16, (13, 9)
    ids = torch.randint(3, 50, (2, n), generator=g)  # under the tiny vocabulary (52)
    labels = ids.clone()
    for row, length in enumerate(lens):
        ids[row, length:] = 0
        labels[row, length:] = -100
    return {"input_ids": ids, "position_ids": torch.arange(n).expand(2, n).clone(), "labels": labels}


def packed() -> dict[str, Tensor]:
    """The two rows of :func:`batch` packed into one row, position ids restarting at the second."""
    rows = batch()
    ids = torch.cat([rows["input_ids"][0, :13], rows["input_ids"][1, :9], torch.zeros(2, dtype=torch.long)])
    labels = torch.cat([rows["labels"][0, :13], rows["labels"][1, :9], torch.full((2,), -100)])
    labels[12] = -100  # the first sequence's last token predicts nothing of the second
    pos = torch.cat([torch.arange(13), torch.arange(9), torch.arange(9, 11)])
    return {"input_ids": ids[None], "position_ids": pos[None], "labels": labels[None]}


def engine_update_ratio(
    model_path: str,
    mpu: object,
    shard: dict[str, Tensor],
    weights: Tensor,
    total: int,
    ref: dict[str, Tensor],
    stage: int,
    reduce_scatter: bool,
) -> float:
    """One SGD step (lr 1, no clipping) of a DeepSpeed engine built with the sequence-parallel ``mpu`` on
    this rank's shard: the largest ratio of the applied update's norm to the one-rank gradient's, over the
    parameters (1.0 when the engine sums the shards' gradients as it should)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": shard["input_ids"].shape[0],
        "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter},
        "zero_allow_untested_optimizer": True,  # plain SGD: the update is the gradient
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    engine.backward(-(token_logprobs(logits, shard["shift_labels"]) * weights).sum() / total)
    engine.step()
    ratios = []
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            update = before[name] - p.detach()
        ratios.append((update.norm() / ref[name].norm()).item())
    return max(ratios, key=lambda r: abs(r - 1.0))


def main() -> None:
    model_path, out, swap = sys.argv[1], Path(sys.argv[2]), "--swap-shards" in sys.argv
    init_distributed(torch.device("cpu"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    data = packed() if "--packed" in sys.argv else batch()
    total = int((data["labels"] != -100).sum())

    # (a) the whole sequence on this rank, no sequence parallelism
    shift = torch.nn.functional.pad(data["labels"], (0, 1), value=-100)[:, 1:]
    logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits
    ref_logp = token_logprobs(logits, shift)
    loss_of(ref_logp, total).backward()
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)

    # (b) the same rows split by sequence over the SP group, through DeepSpeed's Ulysses pieces
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=data["input_ids"].shape[0],
    )
    group = mpu.get_sequence_parallel_group()
    sp_rank = mpu.get_sequence_parallel_rank()
    # The adapter gathers one batch from each SP rank and shards each: every rank passes the same batch
    # here, so its first shard is of that batch.
    loader = UlyssesSPDataLoaderAdapter([data], sp_rank, group, SP, torch.device("cpu"))
    shards = [next(loader) for _ in range(SP)]
    shard = shards[0]
    if swap:  # the mutation: each rank computes its neighbour's slice of the sequence
        other = (sp_rank + 1) % SP
        n = data["input_ids"].shape[1] // SP
        shard = {k: v[:, other * n : (other + 1) * n] if torch.is_tensor(v) else v for k, v in data.items()}
        shard["shift_labels"] = shift[:, other * n : (other + 1) * n]
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    local = token_logprobs(logits, shard["shift_labels"])
    # The loss's weights run over the whole sequence: each rank takes its own slice of them.
    n_local = local.shape[-1]
    weights = torch.linspace(0.5, 1.5, n_local * SP)[sp_rank * n_local : (sp_rank + 1) * n_local]
    (-(local * weights).sum() / total).backward()
    for p in model.parameters():  # each rank holds the gradient of its tokens' share of the loss
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    sp_logp = torch.cat(dist_fn.all_gather(local.detach().contiguous(), group=group), dim=-1)
    sp_grads = grads(model)
    # Without position ids the model numbers each shard from 0 itself: DeepSpeed's assertion that they
    # are passed sees those and stays quiet, and the rotary positions of every shard but the first are wrong.
    with torch.no_grad():
        logits = model(input_ids=shard["input_ids"], use_cache=False).logits
    unnumbered = torch.cat(dist_fn.all_gather(token_logprobs(logits, shard["shift_labels"]), group=group), -1)
    # DeepSpeed engines given the sequence-parallel groups reduce the shards' gradients themselves.
    engine_ratios = {
        f"zero{stage}{'' if rs else '_no_reduce_scatter'}": engine_update_ratio(
            model_path, mpu, shard, weights, total, ref_grads, stage, rs
        )
        for stage, rs in ((0, True), (3, True), (3, False))
    }

    if rank == 0:
        logp_err = (sp_logp - ref_logp.detach()).abs().max().item()
        grad_err = max((sp_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        out.write_text(
            json.dumps(
                {
                    "logp_max_abs_diff": logp_err,
                    "grad_max_abs_diff": grad_err,
                    "no_position_ids_logp_max_abs_diff": (unnumbered - ref_logp.detach()).abs().max().item(),
                    "engine_update_ratio": engine_ratios,
                    "grad_keys_equal": sorted(sp_grads) == sorted(ref_grads),
                    "shard_len": n_local,
                    "ref_logp_abs_mean": ref_logp.abs().mean().item(),
                    "deepspeed": deepspeed.__version__,
                }
            )
        )
    dist.barrier()


if __name__ == "__main__":
    main()
