"""What the pipeline prints about a finished stage: its headline metric, before and after.

The pipeline's own loop (``stages/pipeline.py``) and the sft + rm schedule (``stages/schedule.py``) both
print it when a stage ends, and the pipeline's summary once more for every stage.
"""

from __future__ import annotations

from typing import Any


def headline(stage: str, r: dict[str, Any]) -> str:
    """One line for a finished stage: PPO's rewards, gold curve and task score; an offline stage's headline
    metric before and after, and its task score."""
    if stage == "ppo":
        parts = [f"{r['steps']} steps"]
        if "reward/reward_model" in r:
            rm = r["reward/reward_model"]
            parts.append(f"reward-model score {rm['first']:.3f} -> {rm['last']:.3f}")
        rule = [k for k in r if k.startswith("reward/") and k not in ("reward/mean", "reward/reward_model")]
        for key in rule:
            parts.append(f"{key} (never trained on) {r[key]['first']:.3f} -> {r[key]['last']:.3f}")
        if "curve" in r:
            c, best = r["curve"], r["best_version"]
            parts.append(
                f"gold {c[0]['gold']:.3f} -> {c[-1]['gold']:.3f} at sqrt(KL) {c[-1]['sqrt_kl']:.2f}, best v{best}"
                + (
                    f" ({'early stop' if r['stopped_early'] else 'stop'}: {r['stop_reason']})"
                    if "stop_reason" in r
                    else ""
                )
            )
        if "task_score" in r:
            parts.append(f"task score {r['task_score']:.3f}")
        return "; ".join(parts)
    key = r["headline"]
    before, after = r["before"].get(key), r["after"].get(key)
    text = f"{key} {before:.3f} -> {after:.3f}" if before is not None else f"{key} {after:.3f}"
    text += f" in {r['steps']} steps" + (" (early stop)" if r.get("stopped_early") else "")
    if "task_score" in r:
        text += f"; task score {r['task_score_base']:.3f} (base) -> {r['task_score']:.3f}"
    return text
