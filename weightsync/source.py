"""Full actor parameters out of a learner, one group at a time, under Hugging Face names.

With ZeRO-3 each rank holds a slice of every parameter; :func:`named_full_parameters` all-gathers a group
of parameters (``deepspeed.zero.GatheredParameters``), yields full copies, and releases the group before
gathering the next, so peak extra memory is one group rather than the model. The gather is a collective:
iterate it to the end on every rank, in the same order (a publisher on a rank other than 0 just drains it;
see :func:`weightsync.make_publisher`). With ZeRO-0/1/2 or a plain module parameters are already whole and
are yielded without a copy.

Names are the module's own ``named_parameters()`` names (DeepSpeed's ``module.`` wrapper is unwrapped), so
they match the actor's ``state_dict()`` on the rollout servers. Tied aliases appear once (an HF model with
tied embeddings yields ``model.embed_tokens.weight`` and no ``lm_head.weight``); buffers are not sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def unwrap(model_or_engine: nn.Module) -> nn.Module:
    """The user's module inside a DeepSpeed engine or DDP wrapper (whose parameter names start ``module.``)."""
    from deepspeed import DeepSpeedEngine

    if isinstance(model_or_engine, DeepSpeedEngine | nn.parallel.DistributedDataParallel):
        return model_or_engine.module
    return model_or_engine


def is_zero3(module: nn.Module) -> bool:
    """ZeRO-3 marks every partitioned parameter with a ``ds_id``."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def named_full_parameters(
    model_or_engine: nn.Module, *, group_mb: int = 256
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every parameter; a collective under ZeRO-3 (call on all ranks).

    Under ZeRO-3 parameters are gathered ``group_mb`` MiB at a time and each yielded tensor is a copy the
    caller may keep; otherwise tensors alias the live parameters (valid until the next optimizer step).
    """
    module = unwrap(model_or_engine)
    named = list(module.named_parameters())
    if not is_zero3(module):
        for name, p in named:
            yield name, p.detach()
        return

    import deepspeed

    budget = group_mb << 20
    group: list[tuple[str, nn.Parameter]] = []
    size = 0
    for i, (name, p) in enumerate(named):
        group.append((name, p))
        size += p.ds_numel * p.element_size()
        if size >= budget or i == len(named) - 1:
            with deepspeed.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                for n, q in group:
                    yield n, q.data.detach().clone()  # the gathered storage is freed on exit
            group, size = [], 0
