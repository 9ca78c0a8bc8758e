"""The task score of a policy checkpoint: sample completions of held-out prompts, score them with a rule.

The pipeline (``stages/pipeline.py``) measures every policy it produces this way: the base model, the SFT
model, the PPO model, the same prompts, the same sampling (the rollout servers' temperature and length),
the same seed. The rule (e.g. ``toy.tasks.echo:reward``) is one PPO never trains on when its reward is
the reward model: it is the held-out judge of whether RLHF helped (docs/stages.md §4).

:func:`sample` is the sampling every such measurement shares (and the preference data of
``stages/preferences.py``); :func:`rule_value` reads a rule's result (a dict's parts summed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.data import load_prompts, prompt_token_ids
from tandem.rewards import load_callable


@dataclass
class Sample:
    """One completion of one prompt: its record, the prompt and completion token ids and text."""

    record: dict[str, Any]
    prompt_ids: list[int]
    ids: list[int]
    text: str


def rule_value(value: float | dict[str, float]) -> float:
    return sum(value.values()) if isinstance(value, dict) else float(value)


def load_policy(model_dir: str | Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tok


@torch.no_grad()
def sample(
    model: Any,
    tok: Any,
    records: list[dict[str, Any]],
    *,
    samples: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    chat_template: bool = False,
    seed: int = 0,
    batch_rows: int = 256,
) -> list[list[Sample]]:
    """``samples`` completions of every record's prompt (one list per record, in order), at
    ``temperature`` (0: greedy), up to ``max_new_tokens``; the text has special tokens removed. Prompts of
    one token length are generated together, up to ``batch_rows`` sequences at a time (no padding)."""
    torch.manual_seed(seed)
    prompts = [prompt_token_ids(tok, rec["prompt"], chat_template=chat_template) for rec in records]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(i)
    out: list[list[Sample]] = [[] for _ in records]
    per_call = max(1, batch_rows // samples)
    for length in sorted(by_len):
        members = by_len[length]
        for start in range(0, len(members), per_call):
            chunk = members[start : start + per_call]
            ids = torch.tensor([prompts[i] for i in chunk]).repeat_interleave(samples, 0)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            for r, row in enumerate(gen[:, length:].tolist()):
                i = chunk[r // samples]
                # generate pads a finished row: keep up to and including its end-of-sequence token
                if tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id) + 1]
                out[i].append(Sample(records[i], prompts[i], row, tok.decode(row, skip_special_tokens=True)))
    return out


@torch.no_grad()
def task_score(
    model_dir: str | Path,
    prompts_file: str | Path,
    rule: str,
    *,
    n_prompts: int = 64,
    samples: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    chat_template: bool = False,
    seed: int = 0,
) -> float:
    """Mean of ``rule(prompt, completion, record)`` (dict results summed) over ``samples`` completions of
    each of the first ``n_prompts`` prompts, sampled at ``temperature`` (0: greedy)."""
    records = load_prompts(prompts_file)[:n_prompts]
    _, scores = scored_samples(
        model_dir,
        records,
        load_callable(rule),
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        chat_template=chat_template,
        seed=seed,
    )
    values = [v for group in scores for v in group]
    return sum(values) / len(values)


def scored_samples(
    model_dir: str | Path, records: list[dict[str, Any]], rule: Callable[..., Any], **sampling: Any
) -> tuple[list[list[Sample]], list[list[float]]]:
    """``samples`` completions of each record by the policy in ``model_dir`` (:func:`sample`'s keywords),
    and each one's ``rule(prompt, completion, record)`` value (dict results summed), group by group."""
    model, tok = load_policy(model_dir)
    groups = sample(model, tok, records, **sampling)
    return groups, [[rule_value(rule(s.record["prompt"], s.text, s.record)) for s in g] for g in groups]
