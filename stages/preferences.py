"""Preference pairs from the policy's own samples, labelled by a judge (InstructGPT's comparison data).

The reward model should rank what PPO will show it: completions of the policy it starts from, not an ideal
answer against a hand-made near miss (a model trained on those learns "perfect or not" and says nothing
about the SFT model's mistakes; docs/stages.md §4.2). So, for each prompt:

1. sample ``samples`` completions from the policy (``stages.evaluate.sample``: the rollout temperature and
   length);
2. score each with the *judge*, ``module:function(prompt, completion, record) -> float | dict`` (a task's
   rule here, a learned reward function or an LLM judge in general; a dict's parts are summed);
3. every two distinct completions whose judge scores differ make a candidate pair (chosen: the higher);
   ties and duplicates say nothing and are dropped;
4. ``selection`` picks ``budget`` of the candidates to label: ``random``, or ``margin`` (active learning:
   the pairs a current reward model is least sure of, the smallest ``|r(a) − r(b)|``, scored by
   ``margin_fn``). The judge is called on every sample here (it is cheap); with a costly judge the
   selection is what bounds the labelling.

The output is the ``rm`` recipe's ``{"prompt", "chosen", "rejected"}`` JSONL (docs/stages.md §2).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stages.evaluate import Sample

Candidate = tuple[dict[str, Any], str, str, float]  # record, chosen text, rejected text, judge gap


def candidate_pairs(groups: Sequence[Sequence[Sample]], scores: Sequence[Sequence[float]]) -> list[Candidate]:
    """Every pair of distinct completions of a prompt whose scores differ, higher first. Order: by prompt,
    then by sample index (deterministic)."""
    out: list[Candidate] = []
    for group, values in zip(groups, scores, strict=True):
        seen: dict[str, float] = {}
        for s, v in zip(group, values, strict=True):
            if s.text.strip() and s.text not in seen:
                seen[s.text] = v
        texts = list(seen)
        for i, a in enumerate(texts):
            for b in texts[i + 1 :]:
                if seen[a] != seen[b]:
                    hi, lo = (a, b) if seen[a] > seen[b] else (b, a)
                    out.append((group[0].record, hi, lo, abs(seen[a] - seen[b])))
    return out


def select_pairs(
    candidates: list[Candidate],
    budget: int,
    selection: str = "random",
    *,
    seed: int = 0,
    margin_fn: Callable[[list[Candidate]], list[float]] | None = None,
) -> list[Candidate]:
    """``budget`` candidates (all when fewer): a seeded random choice, or the smallest ``|margin_fn|``
    (ties broken at random). Prompts are spread evenly first: no prompt gives a second pair before every
    prompt with candidates has given one (so a few prompts with many distinct samples cannot take it all)."""
    rng = random.Random(seed)
    if selection == "random":
        keys = [rng.random() for _ in candidates]
    elif selection == "margin":
        if margin_fn is None:
            raise ValueError("selection 'margin' needs a reward model to score the candidates (margin_fn)")
        keys = [abs(m) for m in margin_fn(candidates)]
    else:
        raise ValueError(f"unknown pairs.selection {selection!r}: random or margin")
    by_prompt: dict[str, list[tuple[float, float, int]]] = {}
    for i, (rec, *_rest) in enumerate(candidates):
        by_prompt.setdefault(str(rec.get("id", rec["prompt"])), []).append((keys[i], rng.random(), i))
    ranked = []  # (round, key, tiebreak, index): round r holds each prompt's r-th best candidate
    for items in by_prompt.values():
        ranked += [(r, *item) for r, item in enumerate(sorted(items))]
    return [candidates[i] for *_k, i in sorted(ranked)[:budget]]


def rm_margin_fn(rm_dir: str | Path) -> Callable[[list[Candidate]], list[float]]:
    """``r(chosen) − r(rejected)`` under the reward model in ``rm_dir`` (the rollout server's scoring)."""
    from rollout.reward_model import RewardModel

    rm = RewardModel(str(rm_dir), device="cpu", dtype="float32")

    def margins(cands: list[Candidate]) -> list[float]:
        texts = [rec["prompt"] + t for rec, c, r, _ in cands for t in (c, r)]
        scores = rm.score(texts)
        return [a - b for a, b in zip(scores[0::2], scores[1::2], strict=True)]

    return margins


def policy_preferences(
    policy: str | Path,
    records: list[dict[str, Any]],
    judge: str,
    *,
    samples: int = 8,
    budget: int = 2000,
    selection: str = "random",
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    chat_template: bool = False,
    seed: int = 0,
    rm: str | Path | None = None,
) -> tuple[list[dict[str, str]], dict[str, float]]:
    """Pairs of the policy's own samples, judged and selected (module docstring), and what they were made
    of: prompts, samples, candidate pairs, mean judge score of the samples, mean judge gap of the pairs."""
    from stages.evaluate import scored_samples
    from tandem.rewards import load_callable

    groups, scores = scored_samples(
        policy,
        records,
        load_callable(judge, "judge"),
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        chat_template=chat_template,
        seed=seed,
    )
    cands = candidate_pairs(groups, scores)
    chosen = select_pairs(
        cands, budget, selection, seed=seed, margin_fn=rm_margin_fn(rm) if rm is not None else None
    )
    flat = [v for vs in scores for v in vs]
    stats = {
        "prompts": len(records),
        "samples": len(flat),
        "judge_mean": sum(flat) / max(1, len(flat)),
        "candidates": len(cands),
        "pairs": len(chosen),
        "judge_gap": sum(c[3] for c in chosen) / max(1, len(chosen)),
    }
    return [{"prompt": rec["prompt"], "chosen": c, "rejected": r} for rec, c, r, _ in chosen], stats


def write_pairs(path: str | Path, pairs: list[dict[str, str]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return p
