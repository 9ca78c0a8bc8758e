"""The task score of a policy checkpoint: sample completions of held-out prompts, score them with a rule.

The pipeline (``learner/pipeline.py``) measures every policy it produces this way: the base model, the SFT
model, the PPO model, the same prompts, the same sampling (the rollout servers' temperature and length),
the same seed. The rule (e.g. ``tandem.tasks.echo:reward``) is one PPO never trains on when its reward is
the reward model: it is the held-out judge of whether RLHF helped (docs/stages.md §4).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.data import load_prompts, prompt_token_ids
from tandem.rewards import load_callable


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
    fn = load_callable(rule)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = load_prompts(prompts_file)[:n_prompts]
    torch.manual_seed(seed)
    total, count = 0.0, 0
    for rec in records:
        ids = torch.tensor([prompt_token_ids(tok, rec["prompt"], chat_template=chat_template)])
        out = model.generate(
            ids.repeat(samples, 1),
            attention_mask=torch.ones(samples, ids.shape[1], dtype=torch.long),
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        for row in out[:, ids.shape[1] :]:
            value = fn(rec["prompt"], tok.decode(row, skip_special_tokens=True), rec)
            total += sum(value.values()) if isinstance(value, dict) else float(value)
            count += 1
    return total / count
