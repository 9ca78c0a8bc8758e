"""Supervised warm-start on a task's synthetic demonstrations (prompt -> ideal completion + EOS).

RL from a random init cannot find the ``reverse`` task's reward; a few hundred SFT steps put the policy where
RL has signal to climb. The loss is on completion tokens only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.tasks import demonstrations

log = logging.getLogger(__name__)


def warmstart(
    task: str,
    model_path: str,
    out: str,
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    demos = demonstrations(task, steps * batch_size, seed=seed + 1)
    for step in range(steps):
        chunk = demos[step * batch_size : (step + 1) * batch_size]
        seqs, masks = [], []
        for prompt, answer in chunk:
            p = tok(prompt)["input_ids"]
            a = tok(answer)["input_ids"] + [tok.eos_token_id]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        loss_mask = torch.zeros(len(seqs), width)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
            attn[i, : len(s)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )  # (B, T-1)
        m = loss_mask[:, 1:]
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"warmstart {task} step {step}/{steps} loss {loss.item():.4f}", flush=True)
    path = Path(out)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
