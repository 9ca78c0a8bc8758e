"""tandem against TRL's ``GRPOTrainer`` on the same checkpoint, prompts, reward and hyper-parameters.

    python bench/vs_trl.py [--workload tiny|heavy|both] [--steps N] [--target R] [--trl-env DIR]

Per workload it runs, one after the other in the same invocation: TRL 1.16 ``GRPOTrainer`` (one process),
``launch.py --mode sync`` (each phase on every core, as the phases alternate), ``launch.py --mode async``
and, on request, ``sync-split`` (sync mode with async's thread split, one core per side on 2 cores: the
earlier sync policy, made by replacing the plan's thread split for that run), and prints s/step, time to
``--target`` reward (5-step moving average) and final reward for each, as ratios to TRL. The last line is
one JSON object.
``--rounds N`` repeats the runs N times, interleaved (trl, sync, async, trl, sync, …), and reports the
median of each figure and of each same-round ratio.

On a machine other jobs keep busy, runs that use several torch threads per process (TRL, sync) slow down
far more than single-threaded ones: an OpenMP region waits at its barrier for every thread to be
scheduled. ``--threads N`` pins every run to N torch threads per process (TRL's one process, and each of
tandem's) for a like-for-like comparison under load; say which load a figure was measured under.

Workloads (both the echo task, ``toy.tasks.echo:reward``, 4 prompts × 8 completions per step,
temperature 1, one optimizer step per batch):
  tiny   assets/tiny/actor (the demo's ~80k-parameter model), 8 new tokens, lr 1e-3, 200 steps;
  heavy  a ~3.6M-parameter model from ``python -m toy make-tiny DIR --hidden 256 --layers 6``
         (built under assets/heavy when missing), 64 new tokens, lr 3e-4, 30 steps: generation dominates.

TRL is installed on first use with ``pip install --no-deps --target DIR`` (default ``.venv-trl``, git-ignored)
and layered over this venv through ``PYTHONPATH``, so it runs on the project's own CPU torch and
transformers; the pinned set below is exactly what ``pip install --dry-run trl==1.16.0`` adds to this
venv. Nothing touches a hub: the model is a local directory and the dataset an in-memory
``datasets.Dataset`` built from the same prompt file tandem reads.

How the TRL run is made to match tandem's (learner/models.py, learner/losses.py, learner/advantages.py):
  fp32 on CPU, ``per_device_train_batch_size=32``, ``num_generations=8``, ``steps_per_generation=1``,
  ``num_iterations=1``, no gradient accumulation, no gradient checkpointing (TRL's default is on); torch's
  fused AdamW (TRL's default ``adamw_torch_fused``, and tandem's) with tandem's defaults (β=(0.9, 0.999),
  ε=1e-8, no weight decay), constant learning rate, gradient clip 1.0; ``beta=0`` (no
  reference model, tandem's ``kl_coef: 0``); ``loss_type="dapo"`` (a token-level mean over the whole
  batch, which is tandem's loss aggregation); ε_low 0.2 / ε_high 0.28 as tandem's defaults; GRPO
  advantages scaled by the group std.
Remaining differences, none of which changes the work per step:
  - tandem's std is the unbiased one plus 1e-6 and a constant group gets 0; TRL adds 1e-4 to the std.
  - tandem's loss carries a truncated importance weight exp(prox − behav) ≤ 5 (engine vs learner logprobs);
    TRL, generating with the same model it trains, takes the ratio to the detached current logprobs.
  - TRL's dataloader and tandem's feeder shuffle the prompts with different generators.
  - s/step and time to target count from the end of the first step in all three runs (start-up, model
    loading and the first generation are excluded alike). TRL is one process using every core; tandem
    runs as ``launch.py`` starts it (its own process per role, threads split as launch splits them).
Columns T_gen and T_train: for tandem, the servers' and the learner's busy time per step as in
bench/overlap.py (wall time minus waiting on the other side, so Redis, weight sync and scoring count);
for TRL, the time from the step's start to its reward call and from there to the step's end.
TRL's generation/training split per step is taken at its reward call, which comes right after generation
(no old-logprob pass with one iteration per generation).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# bench/buffer.py and bench/weightsync.py would shadow the packages of the same name.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
_spec = importlib.util.spec_from_file_location("bench_overlap", ROOT / "bench" / "overlap.py")
overlap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlap)
figures, moving_average, run_histories, run_mode = (
    overlap.figures,
    overlap.moving_average,
    overlap.run_histories,
    overlap.run_mode,
)

# Exactly what `pip install --dry-run trl==1.16.0` adds over this venv (torch, transformers, accelerate
# and the rest are already pinned here and must stay the project's).
TRL_PACKAGES = [
    "trl==1.16.0",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "pandas==3.1.1",
    "pyarrow==26.0.1",
]

PROMPTS_PER_STEP = 4
GROUP = 8
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"model": "assets/tiny/actor", "max_new_tokens": 8, "lr": 1e-3, "steps": 200, "target": 0.5},
    "heavy": {"model": "assets/heavy/actor", "max_new_tokens": 64, "lr": 3e-4, "steps": 30, "target": 0.1},
}


# ------------------------------------------------------------------------------------------------ setup


def ensure_trl(env_dir: Path) -> dict[str, str]:
    """The environment for the TRL child: TRL installed under ``env_dir`` if missing, layered over this venv."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(env_dir), str(ROOT)])}
    probe = [sys.executable, "-c", "import trl, datasets; assert trl.__version__ == '1.16.0'"]
    if subprocess.run(probe, env=env, capture_output=True).returncode != 0:
        print(f"[vs_trl] installing {' '.join(TRL_PACKAGES)} into {env_dir}", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps"]
        subprocess.run([*pip, "--target", str(env_dir), *TRL_PACKAGES], check=True)
        subprocess.run(probe, env=env, check=True)
    return env


def ensure_heavy_model(path: Path) -> None:
    if not (path / "config.json").exists():
        out = path.parent
        print(f"[vs_trl] building the heavy model in {out}", flush=True)
        cmd = [sys.executable, "-m", "toy", "make-tiny", str(out), "--hidden", "256", "--layers", "6"]
        subprocess.run(cmd, check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------------------ TRL


def trl_child(args: argparse.Namespace) -> None:
    """Runs inside the TRL environment: train, and write one JSON row per step to ``args.history``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tandem.data import load_prompts
    from toy.tasks.echo import reward as echo_reward

    records = load_prompts(ROOT / "assets/echo.jsonl")
    dataset = Dataset.from_list(records)
    columns = [c for c in dataset.column_names if c != "prompt"]
    marks: dict[str, float] = {}

    def echo(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        """tandem's reward through TRL's signature: each record's other columns come as kwargs lists."""
        marks.setdefault("gen_end", time.perf_counter())
        return [
            echo_reward(p, c, {k: kwargs[k][i] for k in columns})
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]

    rows: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            marks.clear()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            end = time.perf_counter()
            gen_end = marks.get("gen_end", marks["begin"])
            rows.append({"time": time.time(), "t_gen": gen_end - marks["begin"], "t_train": end - gen_end})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs and rows:
                rows[-1]["reward/mean"] = float(logs["reward"])

    config = GRPOConfig(
        output_dir=args.history.parent / "trl-out",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL defaults to True; tandem to False
        seed=0,
        max_steps=args.steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=echo,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    args.history.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_trl(env: dict[str, str], w: dict[str, Any], steps: int, out: Path, threads: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    history = out / "trl_history.jsonl"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_trl",
        "--model",
        str(ROOT / w["model"]),
        "--steps",
        str(steps),
        "--max-new-tokens",
        str(w["max_new_tokens"]),
        "--lr",
        str(w["lr"]),
        "--history",
        str(history),
    ]
    print(f"[vs_trl] trl: {' '.join(cmd[2:])}", flush=True)
    env = {**env, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return [json.loads(line) for line in history.read_text().splitlines()]


def trl_figures(rows: list[dict], target: float) -> dict[str, float | None]:
    """The same figures as bench/overlap.py's, from TRL's per-step rows (counted from the first step's end)."""
    t0 = rows[0]["time"]
    rewards = moving_average([r["reward/mean"] for r in rows])
    hit = next((r["time"] - t0 for r, m in zip(rows, rewards, strict=True) if m >= target), None)
    k = max(1, len(rows) // 10)
    rest = rows[1:]
    return {
        "s_per_step": (rows[-1]["time"] - t0) / (len(rows) - 1),
        "time_to_target_s": hit,
        "final_reward": sum(r["reward/mean"] for r in rows[-k:]) / k,
        "t_gen": sum(r["t_gen"] for r in rest) / len(rest),
        "t_train": sum(r["t_train"] for r in rest) / len(rest),
    }


# ------------------------------------------------------------------------------------------------ tandem


def tandem_overrides(w: dict[str, Any]) -> list[str]:
    return [
        f"model.actor={w['model']}",
        "model.critic=null",
        f"rollout.max_new_tokens={w['max_new_tokens']}",
        f"rollout.n_samples={GROUP}",
        f"rollout.prompts_per_batch={PROMPTS_PER_STEP}",
        "rollout.temperature=1.0",
        f"algorithm.batch_size={PROMPTS_PER_STEP * GROUP}",
        f"algorithm.minibatch_size={PROMPTS_PER_STEP * GROUP}",
        "algorithm.ppo_epochs=1",
        # One server and one learner overlap fully at 1; at 2 the server runs a batch ahead and its data
        # arrives staler (tiny: the same samples/s, staleness 1.0 vs 1.9, reward 0.5 in 3.5 s vs 3.8 s).
        # Pinned here too, so the figures do not move with configs/tiny.yaml.
        "algorithm.max_staleness=1",
        f"learner.micro_batch_size={PROMPTS_PER_STEP * GROUP}",
        f"learner.actor_lr={w['lr']}",
        "logging.wandb_mode=disabled",
    ]


# tandem runs through launch.main with the plan's thread split replaced when asked: ``split`` (async's split
# in sync mode: sync-split) or a fixed count per process (``--threads``).
LAUNCH_WITH_SPLIT = """
import sys
import launch
import launcher.run_plan as plan
how = sys.argv.pop(1)
planned = plan.thread_split
def replaced(cfg, cores=None):
    if how == "split":
        return planned(cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": "async"})}), cores)
    return int(how), int(how)
plan.thread_split = replaced
sys.exit(launch.main(sys.argv[1:]))
"""


def run_tandem(
    run: str, w: dict[str, Any], steps: int, out: Path, target: float, threads: int
) -> dict[str, Any]:
    mode, split = ("sync", "split") if run == "sync-split" else (run, str(threads) if threads else None)
    overrides = tandem_overrides(w)
    if split is None:
        run_dir = run_mode(mode, "configs/tiny.yaml", steps, out, overrides)
    else:
        cmd = [sys.executable, "-c", LAUNCH_WITH_SPLIT, split, "configs/tiny.yaml", f"learner.total_steps={steps}",
               f"run.output_dir={out}", *overrides, "--mode", mode, "--no-console"]  # fmt: skip
        print(f"[vs_trl] {run}: launch.py {' '.join(cmd[4:])} (thread split: {split})", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    learner, servers = run_histories(run_dir)
    f = figures(learner, servers, PROMPTS_PER_STEP * GROUP, target)
    return {**f, "s_per_step": PROMPTS_PER_STEP * GROUP / f["samples_per_s"]}


# ------------------------------------------------------------------------------------------------ report


def _ratio(x: float | None, ref: float | None) -> float | None:
    return None if x is None or ref is None or ref == 0 else round(x / ref, 3)


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f} s"


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _median(xs: list[float | None]) -> float | None:
    """The median of the values that exist (a run that never reached the target has None)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def report(
    name: str, w: dict[str, Any], steps: int, target: float, rounds: list[dict[str, dict]]
) -> dict[str, Any]:
    """Medians over the rounds of each figure, and of each ratio to TRL taken within its own round."""
    print(
        f"\n[vs_trl] {name}: {w['model']}, {PROMPTS_PER_STEP}×{GROUP} completions, {w['max_new_tokens']} new "
        f"tokens, lr {w['lr']}, {steps} steps, target reward {target}; medians of {len(rounds)} round(s)"
    )
    print("| run | s/step | ×TRL | T_gen ms | T_train ms | time to target | ×TRL | final reward |")
    print("|---|---|---|---|---|---|---|---|")
    out: dict[str, Any] = {}
    spread: list[str] = []
    for run in rounds[0]:
        r = {k: _median([rnd[run][k] for rnd in rounds]) for k in rounds[0][run]}
        sp = _median([_ratio(rnd[run]["s_per_step"], rnd["trl"]["s_per_step"]) for rnd in rounds])
        tt = _median([_ratio(rnd[run]["time_to_target_s"], rnd["trl"]["time_to_target_s"]) for rnd in rounds])
        print(
            f"| {run} | {r['s_per_step']:.3f} | {sp:.2f} | {1000 * r['t_gen']:.0f} | {1000 * r['t_train']:.0f} "
            f"| {_s(r['time_to_target_s'])} | {'—' if tt is None else f'{tt:.2f}'} | {r['final_reward']:.3f} |"
        )
        out[f"{name}_{run}_s_per_step"] = round(r["s_per_step"], 4)
        out[f"{name}_{run}_time_to_target_s"] = (
            None if r["time_to_target_s"] is None else round(r["time_to_target_s"], 2)
        )
        out[f"{name}_{run}_final_reward"] = round(r["final_reward"], 3)
        if run != "trl" and len(rounds) > 1:  # the spread behind each median
            per = [
                (_ratio(rnd[run]["s_per_step"], rnd["trl"]["s_per_step"]),
                 _ratio(rnd[run]["time_to_target_s"], rnd["trl"]["time_to_target_s"]))
                for rnd in rounds
            ]  # fmt: skip
            spread.append(f"[vs_trl]   {run} per round ×TRL (s/step, time to target): " + ", ".join(
                f"({_r(a)}, {_r(b)})" for a, b in per))  # fmt: skip
        if run != "trl":
            out[f"{name}_{run}_s_per_step_vs_trl"] = None if sp is None else round(sp, 3)
            out[f"{name}_{run}_time_to_target_vs_trl"] = None if tt is None else round(tt, 3)
    print("\n".join(spread))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["tiny", "heavy", "both"], default="both")
    ap.add_argument("--steps", type=int, default=None, help="learner steps (default: 200 tiny, 30 heavy)")
    ap.add_argument(
        "--target", type=float, default=None, help="reward to reach (default: 0.5 tiny, 0.1 heavy)"
    )
    ap.add_argument("--trl-env", type=Path, default=ROOT / ".venv-trl", help="where TRL is installed")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of every process, TRL's and each of tandem's (0: TRL torch's default, all "
        "cores; tandem as launch.py splits them)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat the runs, interleaved; report medians")
    ap.add_argument("--out", type=Path, default=None, help="directory for the runs (default: a temp dir)")
    ap.add_argument(
        "--runs", default="trl,sync,async", help="comma-separated subset of trl,sync,async,sync-split"
    )
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from toy.tiny import ensure_demo_assets

    ensure_demo_assets(ROOT)
    env = ensure_trl(args.trl_env)
    out = args.out or Path(tempfile.mkdtemp(prefix="tandem-vs-trl-"))
    runs = args.runs.split(",")
    summary: dict[str, Any] = {"threads": args.threads or None, "rounds": args.rounds}
    for name in ["tiny", "heavy"] if args.workload == "both" else [args.workload]:
        w = WORKLOADS[name]
        if name == "heavy":
            ensure_heavy_model(ROOT / w["model"])
        steps = args.steps or w["steps"]
        target = w["target"] if args.target is None else args.target
        rounds: list[dict[str, dict]] = []
        for k in range(args.rounds):
            res: dict[str, dict] = {}
            for run in runs:
                where = out / name / f"round{k}" / run
                if run == "trl":
                    res[run] = trl_figures(run_trl(env, w, steps, where, args.threads), target)
                else:
                    res[run] = run_tandem(run, w, steps, where, target, args.threads)
                # What finished, should a later run die.
                (out / name / f"round{k}" / "results.json").write_text(json.dumps(res))
            rounds.append(res)
        if "trl" in runs:
            summary.update(report(name, w, steps, target, rounds))
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        child = argparse.ArgumentParser()
        child.add_argument("_trl")
        child.add_argument("--model", required=True)
        child.add_argument("--steps", type=int, required=True)
        child.add_argument("--max-new-tokens", type=int, required=True)
        child.add_argument("--lr", type=float, required=True)
        child.add_argument("--history", type=Path, required=True)
        trl_child(child.parse_args())
    else:
        main()
