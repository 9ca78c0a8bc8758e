"""Log-probabilities and entropy straight from the last hidden states, a chunk of tokens at a time.

The plain path (``learner/models.py::policy_logits``) materialises float32 logits ``(tokens, V)``, and
autograd keeps that tensor and a few of its relatives (softmax, their gradients) alive until backward. At
a real vocabulary (V = 151,936) and a few thousand response tokens each of them is gigabytes.

:func:`chunked_logprobs_entropy` computes the same numbers from ``hidden (tokens, H)`` and the head
weight ``(V, H)``: a custom :class:`torch.autograd.Function` walks the tokens in chunks, keeps only
per-token scalars (log-normaliser, entropy) between forward and backward, and recomputes each chunk's
logits in backward to form ``∂/∂hidden`` and ``∂/∂weight`` (the recompute trade of gradient checkpointing,
Chen et al. 2016, applied to the output layer only; Liger-Kernel's fused linear cross-entropy does the same
in Triton). Peak memory is one chunk of logits instead of all of them, at the price of one more
``hidden @ weightᵀ`` per chunk in backward.

The math matches ``learner/losses.py`` exactly: with ``z = (h·Wᵀ + b) / T`` in float32 (``T`` the sampling
temperature; ``T = 0``, greedy, leaves the logits as they are), ``logp = z_y − logsumexp(z)`` and
``H = logsumexp(z) − Σ softmax(z)·z``. Gradients w.r.t. ``z``::

    ∂logp/∂z = onehot(y) − p          ∂H/∂z = p · (E_p[z] − z)

A tied head (weight shared with the input embeddings) needs nothing special: the weight's gradient is
returned to autograd, which adds it to the embedding's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_tokens", "chunked_logprobs_entropy", "chunked_logprobs_top1", "use_chunked_head"]


def use_chunked_head(mode: str, vocab_size: int, tokens: int, threshold: int) -> bool:
    """``learner.chunked_head``: ``on`` always, ``off`` never, ``auto`` when a micro-batch's logits
    (``vocab_size × tokens``) would exceed ``threshold``; below it the logits are small and the plain path
    (no recompute in backward) is faster."""
    return mode == "on" or (mode == "auto" and vocab_size * tokens > threshold)


def chunk_tokens(vocab_size: int, chunk_logits: int) -> int:
    """Tokens per chunk so that one chunk holds about ``chunk_logits`` logits (at least one token)."""
    return max(1, chunk_logits // max(1, vocab_size))


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temp: float) -> Tensor:
    # In the head's dtype, then upcast and divided: what ``policy_logits`` computes on the plain path.
    z = F.linear(h, weight, bias).float()
    return z.div_(temp) if temp != 1.0 else z


class _ChunkedHead(torch.autograd.Function):
    """``(hidden (N, H), weight (V, H), bias (V,) | None, labels (N,)) -> (logp (N,), entropy (N,))``."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temp: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        e_z = torch.zeros_like(logp)  # E_p[z], kept for backward (lse − H would cancel digits)
        entropy = torch.zeros_like(logp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temp)  # (c, V)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = z.gather(-1, labels[s : s + chunk, None]).squeeze(-1) - lse_c
            if with_entropy:
                # Σ softmax(z)·z without a second (c, V) tensor: exp(z − lse) in place is softmax(z).
                ez = (z * (z - lse_c[:, None]).exp_()).sum(-1)
                e_z[s : s + chunk] = ez
                entropy[s : s + chunk] = lse_c - ez
            del z
        # Only per-token scalars stay between forward and backward, never a (N, V) tensor.
        ctx.save_for_backward(hidden, weight, bias, labels, lse, e_z)
        ctx.temp, ctx.chunk, ctx.with_entropy = temp, chunk, with_entropy
        ctx.set_materialize_grads(False)  # an unused output (entropy at coefficient 0) costs nothing
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, g_logp: Tensor | None, g_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse, e_z = ctx.saved_tensors
        temp, chunk = ctx.temp, ctx.chunk
        if not ctx.with_entropy:
            g_entropy = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # A half-precision head accumulates its gradient over chunks in float32, cast once at the end.
        acc_dtype = torch.float32 if weight.dtype not in (torch.float32, torch.float64) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, weight, bias, temp)  # recomputed: (c, V)
            p = (z - lse[s : s + chunk, None]).exp_()  # softmax(z)
            # dz = p · (g_H · (E_p[z] − z) − g_logp) + g_logp · onehot(y), built in z's buffer.
            if g_entropy is not None:
                dz = z.neg_().add_(e_z[s : s + chunk, None]).mul_(g_entropy[s : s + chunk, None])
                if g_logp is not None:
                    dz.sub_(g_logp[s : s + chunk, None])
                dz.mul_(p)
            else:
                dz = p.mul_(-g_logp[s : s + chunk, None])
            del p
            if g_logp is not None:
                dz.scatter_add_(-1, labels[s : s + chunk, None], g_logp[s : s + chunk, None])
            if temp != 1.0:
                dz.div_(temp)  # z = raw / T: the chain rule's 1/T
            dz = dz.to(weight.dtype)  # the backward of ``.float()`` on the plain path
            if grad_h is not None:
                grad_h[s : s + chunk] = dz @ weight
            if grad_w is not None and grad_w.dtype == dz.dtype:
                grad_w.addmm_(dz.t(), h)  # in place: no second (V, H) tensor per chunk
            elif grad_w is not None:
                grad_w.add_((dz.t() @ h).to(acc_dtype))
            if grad_b is not None:
                grad_b.add_(dz.sum(0, dtype=acc_dtype))
            del z, dz
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 256,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-token ``log π(label)`` and entropy of the tempered head ``softmax((h·Wᵀ + b) / T)``.

    ``hidden[..., :]`` must be the state that predicts ``labels[...]`` (already shifted). ``temperature``
    0 (greedy sampling) leaves the logits untempered, as ``policy_logits`` does. ``chunk`` tokens are
    processed at a time (:func:`chunk_tokens`). Without ``with_entropy`` the entropy is zeros and not
    differentiable (the scoring passes need log-probabilities only).

    Shape: hidden (..., H), weight (V, H), labels (...), bias (V,) -> logp (...), entropy (...), float32.
    """
    lead = labels.shape
    temp = temperature if temperature > 0 else 1.0
    logp, entropy = _ChunkedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        labels.reshape(-1).long(),
        temp,
        max(1, int(chunk)),
        with_entropy,
    )
    return logp.reshape(lead), entropy.reshape(lead)


@torch.no_grad()
def chunked_logprobs_top1(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk: int = 256,
) -> tuple[Tensor, Tensor]:
    """Per-token ``log π(label)`` and whether ``label`` is the head's most likely token (untempered, no
    gradient): a teacher-forced evaluation's loss and token accuracy, one chunk of logits at a time.

    Shape: hidden (..., H), weight (V, H), labels (...) -> logp (...) float32, top1 (...) float32 (1 or 0).
    """
    lead = labels.shape
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    logp = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
    top1 = torch.empty_like(logp)
    for s in range(0, labels.shape[0], max(1, int(chunk))):
        z = _chunk_logits(hidden[s : s + chunk], weight, bias, 1.0)  # (c, V)
        y = labels[s : s + chunk, None]
        logp[s : s + chunk] = (z.gather(-1, y) - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(-1)
        top1[s : s + chunk] = (z.argmax(-1, keepdim=True) == y).squeeze(-1).float()
    return logp.reshape(lead), top1.reshape(lead)
