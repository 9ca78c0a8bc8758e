"""Reward over-optimisation made visible and stopped: gold against proxy against KL (Gao et al., 2022).

PPO maximises a *proxy* (the reward model, or whatever ``reward`` is configured); what we want is the
*gold* score (here the task's rule, which PPO never sees). Past some distance from the reference policy the
proxy keeps rising while the gold falls: "Scaling Laws for Reward Model Overoptimization" (Gao, Schulman
and Hilton, 2022) plot both against ``√KL(π‖π_ref)``. :class:`GoldMonitor` measures one point of that curve
for a policy snapshot on held-out prompts:

- ``gold``: the mean gold rule over ``samples`` completions per prompt;
- ``proxy``: the mean PPO reward of the same completions (``model_weight`` × reward model + the weighted
  reward functions, exactly the rollout servers' sum, before clipping);
- ``kl``: the mean over completions of ``Σ_t log π(y_t) − log π_ref(y_t)``, the sequence KL's Monte Carlo
  estimate (k1; it can dip below 0 by noise near the reference, so ``sqrt_kl`` uses ``max(kl, 0)``).

:func:`stop_reason` is the control: stop after ``patience`` evaluations without a better gold, or at once
when the gold falls below ``(1 − max_drop)`` × its best; :func:`diverging` flags the signature of
over-optimisation, proxy up while gold goes down. :func:`plot` draws the curve. :class:`PPOWatch` runs
them over one PPO run of the pipeline.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stages.evaluate import Sample, load_policy, rule_value, sample
from tandem.config import Config

if TYPE_CHECKING:
    from stages.pipeline_config import Monitor

log = logging.getLogger("pipeline")


@torch.no_grad()
def sequence_logprobs(model: Any, samples: list[Sample], batch: int = 256) -> list[float]:
    """``Σ_t log p(y_t | prompt, y_<t)`` of every sample's completion under ``model`` (right-padded
    batches; a pad position is masked out, and causal attention keeps it from the real ones)."""
    out = []
    for i in range(0, len(samples), batch):
        chunk = samples[i : i + batch]
        seqs = [s.prompt_ids + s.ids for s in chunk]
        width = max(len(q) for q in seqs)
        ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
        logp = torch.log_softmax(model(ids).logits.float(), -1)  # (b, width, V)
        for row, s in enumerate(chunk):
            if not s.ids:
                out.append(0.0)
                continue
            start = len(s.prompt_ids)
            pred = logp[row, start - 1 : start - 1 + len(s.ids)]
            out.append(pred.gather(-1, torch.tensor(s.ids)[:, None]).sum().item())
    return out


class GoldMonitor:
    """One (version, gold, proxy, KL) point per policy snapshot on fixed held-out prompts."""

    def __init__(
        self,
        reference: str | Path,
        records: list[dict[str, Any]],
        gold: str,
        *,
        reward_model: str | Path | None = None,
        reward: Any = None,
        model_weight: float = 1.0,
        samples: int = 4,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        chat_template: bool = False,
        seed: int = 0,
    ) -> None:
        from tandem.rewards import RewardFunctions, load_callable

        self.ref, self.tok = load_policy(reference)
        self.records, self.gold = records, load_callable(gold, "gold scorer")
        self.functions = RewardFunctions(reward) if reward is not None else None
        self.rm = None
        if reward_model is not None and model_weight != 0:
            from rollout.reward_model import RewardModel

            self.rm = RewardModel(str(reward_model), device="cpu", dtype="float32")
        self.model_weight = model_weight
        self.kwargs = dict(
            samples=samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            chat_template=chat_template,
            seed=seed,
        )

    def evaluate(self, policy: str | Path, version: int) -> dict[str, float]:
        model, _ = load_policy(policy)
        flat = [s for g in sample(model, self.tok, self.records, **self.kwargs) for s in g]
        gold = [rule_value(self.gold(s.record["prompt"], s.text, s.record)) for s in flat]
        proxy = [0.0] * len(flat)
        if self.functions is not None:
            proxy = [self.functions.score(s.record["prompt"], s.text, s.record)[0] for s in flat]
        if self.rm is not None:
            scores = self.rm.score([s.record["prompt"] + s.text for s in flat])
            proxy = [p + self.model_weight * r for p, r in zip(proxy, scores, strict=True)]
        lp, lp_ref = sequence_logprobs(model, flat), sequence_logprobs(self.ref, flat)
        kl = sum(a - b for a, b in zip(lp, lp_ref, strict=True)) / len(flat)
        n = len(flat)
        return {
            "version": version,
            "gold": sum(gold) / n,
            "proxy": sum(proxy) / n,
            "kl": kl,
            "sqrt_kl": math.sqrt(max(kl, 0.0)),
        }


def best_index(points: list[dict[str, float]]) -> int:
    """The point with the highest gold (the earliest of equals)."""
    return max(range(len(points)), key=lambda i: (points[i]["gold"], -i))


def stop_reason(golds: list[float], patience: int, max_drop: float) -> str | None:
    """Why to stop after these gold scores (oldest first), or None. ``patience`` evaluations since the
    best without beating it (0: never on that account); the last gold below ``(1 − max_drop)`` × the best
    (``max_drop`` 1: never)."""
    if not golds:
        return None
    best = max(golds)
    since = len(golds) - 1 - golds.index(best)
    if patience and since >= patience:
        return f"gold has not improved for {since} evaluations (best {best:.3f})"
    if best > 0 and golds[-1] < (1.0 - max_drop) * best:
        return f"gold fell to {golds[-1]:.3f}, below {1.0 - max_drop:.2f} x its best {best:.3f}"
    return None


def diverging(points: list[dict[str, float]], tol: float = 0.05) -> bool:
    """Proxy up and gold down (each by more than ``tol``) between the last two points."""
    if len(points) < 2:
        return False
    a, b = points[-2], points[-1]
    return b["proxy"] > a["proxy"] + tol and b["gold"] < a["gold"] - tol


def plot(points: list[dict[str, float]], path: str | Path, title: str = "") -> Path | None:
    """Gold and proxy against √KL (two y axes: their scales differ); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [p["sqrt_kl"] for p in points]
    fig, gold_ax = plt.subplots(figsize=(6, 4))
    gold_ax.plot(x, [p["gold"] for p in points], "o-", color="tab:green", label="gold (rule)")
    gold_ax.set_xlabel("√KL(π ‖ π_ref) (nats^½)")
    gold_ax.set_ylabel("gold score", color="tab:green")
    proxy_ax = gold_ax.twinx()
    proxy_ax.plot(x, [p["proxy"] for p in points], "s--", color="tab:blue", label="proxy (PPO reward)")
    proxy_ax.set_ylabel("proxy reward", color="tab:blue")
    for p in points:
        gold_ax.annotate(f"v{int(p['version'])}", (p["sqrt_kl"], p["gold"]), fontsize=7)
    gold_ax.set_title(title or "gold vs proxy against √KL (Gao et al. 2022)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


class PPOWatch:
    """The gold monitor over one PPO run: evaluates each new snapshot in version order, once (a re-run
    reads ``curve.jsonl`` back), decides the stop, and at the end picks the best-gold policy and draws
    the curve (``curve.png``)."""

    def __init__(self, gold: Any, m: Monitor, stage_dir: Path, cfg: Config) -> None:
        self.gold, self.m, self.stage_dir, self.cfg = gold, m, stage_dir, cfg
        self.curve_path = stage_dir / "curve.jsonl"
        self.points: list[dict[str, Any]] = []
        if self.curve_path.exists():
            self.points = [json.loads(line) for line in self.curve_path.read_text().splitlines() if line]
        self.stop: str | None = None  # why to stop, once decided
        self.signalled = False  # whether PPO was still running then, and was stopped
        self.warnings: list[str] = []
        if not self.points:  # version 0: the reference (SFT) policy itself
            self.add(Path(cfg.model.actor), 0)

    def run_dir(self) -> Path | None:
        runs = sorted(self.stage_dir.glob(f"{self.cfg.run.name}-*"))
        return runs[-1] if runs else None

    def add(self, policy: Path, version: int) -> None:
        point = {**self.gold.evaluate(policy, version), "path": str(policy)}
        self.points.append(point)
        with open(self.curve_path, "a") as f:
            f.write(json.dumps(point) + "\n")
        log.info(
            "ppo v%d: gold %.3f, proxy %.3f, KL %.3f", version, point["gold"], point["proxy"], point["kl"]
        )
        if diverging(self.points):
            prev = self.points[-2]
            w = (
                f"v{version}: proxy rose {prev['proxy']:.3f} -> {point['proxy']:.3f} while gold fell"
                f" {prev['gold']:.3f} -> {point['gold']:.3f} (over-optimisation)"
            )
            self.warnings.append(w)
            print(f"[pipeline] ppo: warning: {w}", flush=True)

    def poll(self, run_dir: Path | None) -> bool:
        """Evaluate the snapshots not yet seen; True when the run should stop (first time only)."""
        if run_dir is None or self.stop is not None:  # stopped: what came after is not looked at
            return False
        seen = {int(p["version"]) for p in self.points}
        snaps = sorted((run_dir / "snapshots").glob("v[0-9]*[0-9]"))
        for snap in snaps:
            version = int(snap.name[1:])
            if version in seen:
                continue
            self.add(snap, version)
            self.stop = stop_reason([p["gold"] for p in self.points], self.m.patience, self.m.max_drop)
            if self.stop is not None:
                return True
        return False

    def result(self, run_dir: Path) -> dict[str, Any]:
        out: dict[str, Any] = {"curve": self.points, "stopped_early": self.signalled}
        if self.stop is not None:
            out["stop_reason"] = self.stop
        if self.warnings:
            out["warnings"] = self.warnings
        best = self.points[best_index(self.points)]
        out["best_version"] = int(best["version"])
        if self.m.keep_best:
            out["final_trained"] = str(run_dir / "final")
            out["final"] = best["path"]
        png = plot(self.points, self.stage_dir / "curve.png", f"{self.cfg.run.name}: gold vs proxy")
        if png is not None:
            out["curve_png"] = str(png)
        return out
