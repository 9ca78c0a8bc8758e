"""Mixture-of-experts models in the learner: ZeRO-3 leaf modules, router load metrics, the load-balancing loss.

- **Leaf modules.** A sparse MoE block runs only the experts its tokens were routed to, so under ZeRO-3 the
  ranks of one forward pass fetch different parameters in a different order and the prefetcher's trace no
  longer matches; :func:`set_leaf_modules` registers each MoE block as a ZeRO-3 leaf
  (``deepspeed.utils.set_z3_leaf_modules``): all its parameters are gathered at once, on every rank.
- **The blocks are found generically** (:mod:`tandem.routers`): transformers declares each MoE model's router class as the
  ``router_logits`` output recorder (``_can_record_outputs``), the same hook ``output_router_logits=True``
  uses; the MoE block is the router's parent module (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``,
  ``GptOssMLP``). A dense model has no router: every function here is a no-op on it.
- **Router metrics** (:func:`router_metrics`) from the router logits of the training forward pass, which
  :class:`RouterTap` records with the recorder's own hook: per layer, each expert's share of the routed
  token slots (``load``, summing to 1; uniform is ``1/E``) and its imbalance, max/mean (1 when uniform, ``E``
  when one expert takes everything) and the coefficient of variation (std/mean, 0 when uniform).
- **Load-balancing loss** (``learner.moe_aux_loss_coef``, off by default as RL peers run MoE): the Switch
  Transformer auxiliary loss, computed by the model's own ``load_balancing_loss_func`` on the same logits.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tandem.routers import router_class, routers

# Above this many (layer, expert) pairs only the per-layer summaries are logged, not every expert's load
# (Qwen3-30B-A3B has 48 x 128).
PER_EXPERT_LIMIT = 256


def moe_block_classes(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of the modules that hold a router: the sparse MoE blocks (``Qwen3MoeSparseMoeBlock``)."""
    cls = router_class(model)
    if cls is None:
        return []
    found = {type(m) for m in model.modules() if any(isinstance(c, cls) for c in m.children())}
    return sorted(found, key=lambda c: c.__name__)


def is_moe(model: nn.Module) -> bool:
    return router_class(model) is not None


def set_leaf_modules(model: nn.Module) -> list[type[nn.Module]]:
    """Register ``model``'s MoE blocks as ZeRO-3 leaf modules (before ``deepspeed.initialize``); returns them."""
    classes = moe_block_classes(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return classes


def top_k(model: nn.Module) -> int:
    """Experts per token of ``model``'s routers."""
    (first, *_) = routers(model)
    return int(first.top_k)


# ------------------------------------------------------------------------------------------ pure metrics


def expert_load(router_logits: Tensor, k: int, valid: Tensor | None = None) -> Tensor:
    """Each expert's share of the ``k`` slots every valid token is routed to; sums to 1.

    Shape: router_logits (T, E), valid (T,) bool or None -> (E,) float32.
    """
    chosen = router_logits.detach().float().topk(k, dim=-1).indices  # (T, k): softmax keeps the order
    if valid is not None:
        chosen = chosen[valid.reshape(-1).bool()]
    counts = torch.bincount(chosen.reshape(-1), minlength=router_logits.shape[-1]).float()
    return counts / counts.sum().clamp(min=1)


def load_imbalance(load: Tensor) -> tuple[Tensor, Tensor]:
    """(max/mean, coefficient of variation std/mean) of an expert load vector (E,): (1, 0) when uniform."""
    mean = load.mean()
    return load.max() / mean, load.std(unbiased=False) / mean


def router_metrics(
    layers: list[Tensor], k: int, valid: Tensor | None = None, *, per_expert: bool | None = None
) -> dict[str, Tensor]:
    """``moe/...`` metrics of one forward pass's router logits, one (T, E) tensor per MoE layer.

    Per layer ``i``: ``moe/imbalance/l{i}`` (max/mean load), ``moe/load_cv/l{i}``, ``moe/load_max/l{i}``
    and, below :data:`PER_EXPERT_LIMIT` pairs (or as ``per_expert`` says), ``moe/load/l{i}/e{j}``; over
    layers, ``moe/imbalance`` and ``moe/load_cv`` (means).
    """
    out: dict[str, Tensor] = {}
    if not layers:
        return out
    if per_expert is None:
        per_expert = len(layers) * layers[0].shape[-1] <= PER_EXPERT_LIMIT
    ratios, cvs = [], []
    for i, logits in enumerate(layers):
        load = expert_load(logits, k, valid)
        ratio, cv = load_imbalance(load)
        ratios.append(ratio)
        cvs.append(cv)
        out[f"moe/imbalance/l{i}"], out[f"moe/load_cv/l{i}"], out[f"moe/load_max/l{i}"] = (
            ratio,
            cv,
            load.max(),
        )
        if per_expert:
            out.update({f"moe/load/l{i}/e{j}": x for j, x in enumerate(load)})
    out["moe/imbalance"], out["moe/load_cv"] = torch.stack(ratios).mean(), torch.stack(cvs).mean()
    return out


def aux_loss(model: nn.Module, layers: list[Tensor], valid: Tensor | None = None) -> Tensor:
    """The model's own load-balancing loss (transformers' ``load_balancing_loss_func`` of its modeling
    module, as its forward computes it with ``output_router_logits=True``) on recorded router logits."""
    cls = router_class(model)
    fn = getattr(sys.modules[cls.__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(
            f"{cls.__module__} has no load_balancing_loss_func; set learner.moe_aux_loss_coef: 0"
        )
    num_experts = layers[0].shape[-1]
    mask = None if valid is None else valid.reshape(-1)
    return fn(tuple(layers), num_experts, top_k(model), mask)


class RouterTap:
    """Records the router logits of the forward passes run inside :meth:`recording` (with their gradient).

    A forward hook per router, taking the output ``_can_record_outputs`` names (index 0: the logits), as
    ``output_router_logits=True`` does; only inside :meth:`recording`, so a gradient-checkpointing
    recompute in backward records nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.k = top_k(model)
        self.layers: list[Tensor] = []
        self._on = False
        self._handles = [r.register_forward_hook(self._hook) for r in routers(model)]

    @classmethod
    def of(cls, model: nn.Module) -> RouterTap | None:
        """A tap on ``model``'s routers, or None for a dense model."""
        return cls(model) if is_moe(model) else None

    def _hook(self, module: nn.Module, args: object, output: tuple[Tensor, ...]) -> None:
        if self._on:
            self.layers.append(output[0])

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Tensor]]:
        """The list the logits of the enclosed forward passes land in, one (T, E) tensor per layer."""
        self.layers, self._on = [], True
        try:
            yield self.layers
        finally:
            self._on = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def token_mask(input_ids: Tensor, seq_lens: Tensor | None) -> Tensor | None:
    """Which positions of a micro-batch's ``input_ids`` are tokens: the first ``seq_lens[r]`` of each padded
    row; a packed micro-batch (``seq_lens`` None) is all tokens. Shape: (rows, N) bool or None."""
    if seq_lens is None:
        return None
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    return cols[None, :] < seq_lens.to(input_ids.device)[:, None]
