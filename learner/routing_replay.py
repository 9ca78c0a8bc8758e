"""Routing replay (R3): the learner's MoE routers choose the experts the rollout engine chose.

The engine and the learner compute the same router logits only up to numerical noise (kernels, dtypes,
batch shapes), and a token whose k-th and (k+1)-th logits are close flips to another expert: the learner
then scores a token through experts the engine never ran. With ``algorithm.routing_replay: rollout`` the
engine records each token's top-k expert indices per MoE layer (``Trajectory.routed_experts``) and the
learner's forward forces every router to select exactly those. The routing *weights* still come from the
learner's own router logits, normalised over the recorded experts as the router normalises its own top-k,
so the router keeps its gradient.

- :func:`forced_routing` (pure): the ``(scores, indices)`` a router would return had its top-k been the
  recorded indices; bit-identical to the router's own output when they are its own top-k.
- :class:`RoutingReplay`: a forward hook per router that, inside :meth:`RoutingReplay.replaying`, replaces
  the router's output by the forced one on every recorded token (a position without a record, -1, keeps
  the router's own choice), and counts routing flips (``moe/routing_flips``: the share of token-layer
  slots whose own top-k set differs from the recorded one) whether it forces or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from learner.moe import routers

# How each router class turns its logits into top-k weights. "softmax": softmax over all experts in float32,
# top-k, renormalised when ``norm_topk_prob`` (Qwen3-MoE: then cast to the logits' dtype; Mixtral: always
# renormalised, kept float32). "topk_softmax": top-k of the logits, softmax over those k (GPT-OSS).
ROUTER_STYLES = {
    "Qwen3MoeTopKRouter": "softmax",
    "MixtralTopKRouter": "softmax",
    "GptOssTopKRouter": "topk_softmax",
}


def forced_routing(
    logits: Tensor,
    indices: Tensor,
    *,
    style: str = "softmax",
    norm_topk_prob: bool = True,
    cast: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(scores, indices)`` a router returns had it chosen ``indices``: the weights are its own
    normalisation of its ``logits`` restricted to those experts, so they carry the logits' gradient.

    ``style`` as in :data:`ROUTER_STYLES`; ``cast`` (Qwen3-MoE): scores in the logits' dtype, else float32.
    Shape: logits (T, E), indices (T, k) -> (T, k) scores, (T, k) int64 indices.
    """
    indices = indices.to(device=logits.device, dtype=torch.long)
    if style == "topk_softmax":
        return torch.softmax(logits.gather(-1, indices), dim=1, dtype=logits.dtype), indices
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, indices)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top.to(logits.dtype) if cast else top), indices


def flipped(own: Tensor, recorded: Tensor) -> Tensor:
    """Per token, whether the router's own top-k set differs from the recorded one (order ignored).
    Shape: (T, k), (T, k) -> (T,) bool."""
    return (own.sort(dim=-1).values != recorded.to(own).sort(dim=-1).values).any(dim=-1)


class RoutingReplay:
    """Forward hooks on ``model``'s routers that force recorded routing inside :meth:`replaying`.

    Outside it the hooks do nothing. The layer a hook forces is the router's position in the model, not the
    order the hooks fire in, so a gradient-checkpointing recompute inside the context replays the same
    routing (callers keep the backward pass inside it).
    """

    def __init__(self, model: nn.Module, *, force: bool = True) -> None:
        found = routers(model)
        if not found:
            raise ValueError("routing replay needs a mixture-of-experts model; this one has no router")
        name = type(found[0]).__name__
        if name not in ROUTER_STYLES:
            raise ValueError(
                f"routing replay knows the routers {sorted(ROUTER_STYLES)}, not {name}: how it normalises "
                "its top-k weights is not known"
            )
        self.style = ROUTER_STYLES[name]
        self.force = force
        self.layers = len(found)
        self.k = int(found[0].top_k)
        self.routed: Tensor | None = None  # (T, layers, k) int64, -1 where not recorded
        self.flips = torch.zeros(())  # token-layer slots whose own top-k differs from the record
        self.slots = torch.zeros(())  # recorded token-layer slots seen
        self._counting = False  # from entering replaying() to take_flips(): not a backward's recompute
        self._handles = [
            r.register_forward_hook(self._hook_for(i, r), with_kwargs=False) for i, r in enumerate(found)
        ]

    @classmethod
    def of(cls, model: nn.Module, *, force: bool = True) -> RoutingReplay | None:
        """Hooks on ``model``'s routers, or None for a dense model (or, not forcing, a router not known)."""
        found = routers(model)
        if not found or (not force and type(found[0]).__name__ not in ROUTER_STYLES):
            return None
        return cls(model, force=force)

    def _hook_for(self, layer: int, router: nn.Module) -> Callable[..., object]:
        norm = bool(getattr(router, "norm_topk_prob", True))
        cast = hasattr(router, "norm_topk_prob")  # Qwen3-MoE casts its scores back, Mixtral does not

        def hook(module: nn.Module, args: object, output: tuple[Tensor, Tensor, Tensor]) -> object:
            if self.routed is None:
                return None
            logits, scores, own = output
            recorded = self.routed[:, layer].to(own.device)  # (T, k)
            if recorded.shape[0] != own.shape[0]:
                raise ValueError(
                    f"routing replay: {recorded.shape[0]} recorded positions for a router that saw "
                    f"{own.shape[0]} tokens"
                )
            valid = recorded[:, 0] >= 0
            if self._counting:
                with torch.no_grad():
                    self.flips = self.flips + (flipped(own, recorded) & valid).sum()
                    self.slots = self.slots + valid.sum()
            if not self.force or not bool(valid.any()):
                return None
            indices = torch.where(valid[:, None], recorded, own)
            forced, indices = forced_routing(
                logits, indices, style=self.style, norm_topk_prob=norm, cast=cast
            )
            return logits, forced.to(scores.dtype), indices

        return hook

    @contextlib.contextmanager
    def replaying(self, routed: Tensor | None, *, count: bool = True) -> Iterator[None]:
        """Force ``routed`` (T, layers, k), T the tokens of the enclosed forward passes in the order the
        routers see them (``input_ids`` flattened), on every position not -1; None forces nothing.
        ``count``: routing flips are counted afresh (off around a backward, whose recompute would count
        the same tokens again)."""
        if routed is not None and tuple(routed.shape[1:]) != (self.layers, self.k):
            raise ValueError(
                f"routing replay: recorded routing of {tuple(routed.shape[1:])} (layers, k), the model has "
                f"{(self.layers, self.k)}"
            )
        self.routed, self._counting = routed, count
        if count:
            self.flips, self.slots = torch.zeros(()), torch.zeros(())
        try:
            yield
        finally:
            self.routed = None

    def take_flips(self) -> tuple[Tensor, Tensor]:
        """(flipped slots, recorded slots) of the forward passes since entering :meth:`replaying`; later
        forwards of the same context (a gradient-checkpointing recompute) are not counted."""
        self._counting = False
        return self.flips, self.slots

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
