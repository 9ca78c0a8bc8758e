"""Sampling one token per row, and the behaviour log-probability of what was sampled (docs/design.md §8.2).

Pure tensor math: the distribution is the logits at the call's temperature, truncated by top-k then
top-p and renormalised, and each token's logprob is read from exactly that distribution, so the learner's
importance weights see what was sampled.
"""

from __future__ import annotations

import torch

from rollout.engines.base import SamplingParams


def truncate_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) truncation: tokens outside get ``-inf``. Shape: (B, V) -> (B, V).

    Top-p keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (the token
    that crosses it included), so at least one token always survives.
    """
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_scores.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # (B, V) mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(tokens, behav_logp)``. Shapes: (B, V) -> (B,), (B,).

    Greedy (temperature 0) takes the argmax and reports ``log_softmax(logits)`` at it (see module docs of
    :mod:`rollout.engines.base`).
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)  # (B,)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    scores = truncate_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    logprobs = scores.log_softmax(-1)  # (B, V) the renormalised distribution we sample from
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
