"""Placement in SIMULATION: every fixed placement against the planner's ``auto``, across regimes.

    python bench/placement.py [--devices 8] [--points 9] [--steps 14] [--out runs/bench-placement]

Everything here runs on pretend devices (``placement/sim/engine.py``): locks and memory counters, phases that sleep
for a ground-truth cost the planner never reads. It shows what two CPU cores cannot: 8 accelerators, each
role on its own subset or all of them in turns. Every printed table and the figure say SIMULATION.

1. **Regime sweep.** The generation share of a step goes from ~10% to ~90% (response length against
   prompt length, heavier tails as responses grow). Samples/s of each fixed placement, and of ``auto``
   (profile window, fit, pick, re-plan), normalised to the best fixed placement at that point; ``auto``
   twice: its steady steps in its own run, and its pick measured exactly as the fixed placements are:
   ``colocate``; ``separate`` at 25:75, 50:50 and 75:25; OpenRLHF's colocate_actor_ref +
   colocate_critic_reward (actor and reference on one group, critic and reward model on another);
   ``split`` scoring (colocated, the scoring forwards on disjoint quarters). Every placement at a point
   meets the same batches (the simulator deals each step its own), over the same steps as ``auto``'s
   last plan. Two points are added after the sweep (``EXTRA``): a small batch of long-context samples
   with long-tailed responses (16 samples of 2048 prompt + 1024 response tokens, tail 1.4), as in agentic
   or multi-turn RL. Its decode is held by its longest response, not by its tokens, which is where
   overlapping generation with training pays most and where taking turns costs most. And a small async
   batch on a 7B model (16 samples of 512 + 512 tokens, tail 2.0), whose colocated switch and weight
   copies are priced from that model's bytes at the cost table's rates (``sized_truth``): there the
   per-step switch is a large share of a short step, the regime where colocation loses.
2. **Drift.** The mean response length grows 4x during a run: the best plan at the start held fixed,
   the best at the end held fixed, and ``auto`` re-planning.
3. **Predicted against measured** step time for every plan run, from the model ``auto`` fitted.
4. **Real compute** (``--real``, no simulation): the tiny and generation-heavy workloads of
   ``bench/vs_trl.py`` run colocated (sync, every core to each phase) and separated (async, the cores
   split) through ``launch.py``. The first steps of each run are the profile window; the planner fits
   its laws to them, predicts both plans, and its pick is checked against the measured winner over the
   rest of the runs, round after round.

Writes ``placement.png`` under ``--out``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from placement.cost import Workload, predict  # noqa: E402
from placement.plans import Plan, Roles  # noqa: E402
from placement.sim.auto import run_auto  # noqa: E402
from placement.sim.engine import Cluster, SimRun, step_time  # noqa: E402
from placement.sim.truth import EXAMPLE_PARAMS, GiB, example_truth, sized_truth  # noqa: E402

ROLES = Roles(reference=True, critic=True, reward_model=True)
SAMPLES = 64
TOKENS = 1024  # prompt + response per sample, held so the learner's share moves only through the tails


def fixed_plans(devices: int) -> dict[str, Plan]:
    q = devices // 4
    return {
        "colocate": Plan("colocate", devices, devices),
        "separate 25:75": Plan("separate", q, devices - q),
        "separate 50:50": Plan("separate", 2 * q, devices - 2 * q),
        "separate 75:25": Plan("separate", 3 * q, devices - 3 * q),
        "openrlhf actor+ref | critic+rm": Plan(
            "separate", 2 * q, q, q, reference="learner", critic="own", reward_model="own"
        ),
        "split scoring": Plan("colocate", devices, devices, scoring="split"),
    }


# (label, samples, prompt_len, response_len, tail, parameters): regimes outside the sweep's fixed 1024 tokens
# a sample; parameters None is the sweep's ~1.5B model (example_truth), a number a model of that size whose
# switch and weight copies are priced from its bytes (sized_truth)
EXTRA = [
    ("small batch, long context, long tail", 16, 2048.0, 1024.0, 1.4, None),
    ("small async batch, 7B model", 16, 512.0, 512.0, 2.0, 7e9),
]


def regimes(points: int) -> list[tuple[float, float, float]]:
    """(prompt_len, response_len, Pareto tail) from generation-light to generation-heavy."""
    out = []
    for i in range(points):
        x = i / max(1, points - 1)
        response = 16 * (TOKENS / 16) ** x  # 16 .. 1024, geometric
        prompt = max(16.0, TOKENS - response)
        tail = 3.0 - 1.6 * x  # 3.0 (light) .. 1.4 (heavy)
        out.append((prompt, response, tail))
    return out


def measure(sim: SimRun, plan: Plan, first: int, steps: int) -> float:
    n0 = len(sim.ends)
    sim.run(plan, first, steps)
    return step_time(sim.ends[n0:], warmup=2, drain=sim.drain(plan))


def sweep_point(
    devices: int,
    prompt: float,
    response: float,
    tail: float,
    steps: int,
    seed: int,
    profile_steps: int,
    samples: int = SAMPLES,
    params: float | None = None,
) -> dict:
    work = Workload(samples, prompt, response)
    truth = example_truth(tail=tail) if params is None else sized_truth(params, devices, tail=tail)
    sim = SimRun(Cluster(devices, 80 * GiB), truth, ROLES, lambda i: work, seed=seed)
    auto = run_auto(sim, steps * 3, profile_steps=profile_steps, replan_every=5)
    chosen = auto.switches[-1]
    model = auto.model
    # Every placement runs the batches auto's last plan ran (the simulator deals each step the same
    # batch whatever runs it), so each comparison is between placements, not between batches.
    n = max(steps, auto.steps - chosen.step)
    first = auto.steps - n
    row: dict = {"samples": samples, "prompt_len": round(prompt), "response_len": round(response)}
    row["params"] = params or EXAMPLE_PARAMS
    row["tail"] = round(tail, 2)
    measured, predicted = {}, {}
    for name, plan in fixed_plans(devices).items():
        pred = predict(plan, ROLES, model, work, device_bytes=80 * GiB)
        try:
            measured[name] = measure(sim, plan, first, n)
        except MemoryError as e:  # SimOOM: this placement does not fit here
            measured[name] = float("inf")
            row.setdefault("oom", {})[name] = str(e)
        predicted[name] = pred.step_s if pred.feasible else float("inf")
    # The pick measured as the fixed placements are (the same plan is the same measurement), apart from
    # auto's own run, whose steps include the probes' aftermath and any switch.
    same = [name for name, plan in fixed_plans(devices).items() if plan == chosen.plan]
    pick_s = measured[same[0]] if same else measure(sim, chosen.plan, first, n)
    coloc_gen = [s.value for s in sim.samples if s.name == "generate" and s.devices == devices]
    best_fixed = min(measured.values())
    auto_steady = chosen.measured_s if chosen.measured_s == chosen.measured_s else auto.seconds / auto.steps
    row.update(
        generation_share=round(sum(coloc_gen) / len(coloc_gen) / measured["colocate"], 3),
        samples_per_s={k: round(samples / v, 1) for k, v in measured.items()},
        vs_best_fixed={k: round(best_fixed / v, 3) for k, v in measured.items()},
        auto_plan=chosen.plan.label(ROLES),
        auto_vs_best_fixed=round(best_fixed / auto_steady, 3),
        auto_pick_vs_best_fixed=round(best_fixed / pick_s, 3),
        auto_whole_run_vs_best_fixed=round(best_fixed / (auto.seconds / auto.steps), 3),
        auto_switches=len(auto.switches) - 1,
        predicted_ms={k: round(v * 1e3, 2) for k, v in predicted.items()},
        measured_ms={k: round(v * 1e3, 2) for k, v in measured.items()},
        auto_predicted_ms=round(chosen.predicted_s * 1e3, 2),
        auto_measured_ms=round(auto_steady * 1e3, 2),
    )
    return row


def drift(devices: int, steps: int, seed: int, profile_steps: int) -> dict:
    """Mean response length 4x from start to end; static plans against auto."""
    r0 = 128.0

    def work_at(i: int) -> Workload:
        r = r0 * (1 + 3 * min(1.0, i / max(1, steps - 1)))
        return Workload(SAMPLES, 256.0, r)

    truth = example_truth(tail=2.0)
    sim = SimRun(Cluster(devices, 80 * GiB), truth, ROLES, work_at, seed=seed)
    t0 = time.perf_counter()
    auto = run_auto(sim, steps, profile_steps=profile_steps, replan_every=5)
    auto_s = time.perf_counter() - t0
    from placement.planner import rank

    at_start = auto.switches[0].plan
    at_end = rank(ROLES, devices, auto.model, work_at(steps - 1), device_bytes=80 * GiB)[0].plan
    out = {"auto_s": auto_s, "auto_plans": [s.plan.label(ROLES) for s in auto.switches]}
    for name, plan in (("best_at_start", at_start), ("best_at_end", at_end)):
        run = SimRun(Cluster(devices, 80 * GiB), truth, ROLES, work_at, seed=seed)
        t0 = time.perf_counter()
        run.run(plan, 0, steps)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_plan"] = plan.label(ROLES)
    return out


def real_check(workload: str, steps: int, out: Path, window: int = 8) -> dict:
    """Real compute on this machine's cores: the planner's pick from each run's first steps against the
    measured winner over the rest (docs/placement.md §11.4)."""
    import subprocess

    sys.path.insert(0, str(ROOT / "bench"))
    import vs_trl

    from placement.configured import roles_of
    from placement.cost import CostModel
    from placement.profile import profiled_workload, read_run
    from tandem.config import load_config

    w = vs_trl.WORKLOADS[workload]
    if workload == "heavy":
        vs_trl.ensure_heavy_model(ROOT / w["model"])
    cores = os.cpu_count() or 1
    profiles = {}
    for mode in ("sync", "async"):
        run_out = out / f"real-{workload}-{mode}-{time.strftime('%H%M%S')}"
        cmd = [sys.executable, str(ROOT / "launch.py"), "configs/tiny.yaml", f"learner.total_steps={steps}",
               f"run.output_dir={run_out}", *vs_trl.tandem_overrides(w), "--mode", mode, "--no-console"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (run_dir,) = [p for p in run_out.iterdir() if p.is_dir()]
        profiles[mode] = read_run(run_dir, cores, window=window)
    cfg = load_config(ROOT / "configs/tiny.yaml", vs_trl.tandem_overrides(w))
    model = CostModel.from_samples([s for p in profiles.values() for s in p.samples])
    work = profiled_workload(list(profiles.values()), cfg.algorithm.batch_size)
    roles = roles_of(cfg)
    out_row: dict = {"workload": workload, "cores": cores}
    for mode, prof in profiles.items():
        pred = predict(prof.plan, roles, model, work)
        out_row[mode] = {
            "plan": prof.plan.label(roles),
            "predicted_s": round(pred.step_s, 4),
            "measured_s": round(prof.step_s, 4),
            "window_s": round(prof.window_step_s, 4),
        }
    picked = min(profiles, key=lambda m: out_row[m]["predicted_s"])
    winner = min(profiles, key=lambda m: out_row[m]["measured_s"])
    out_row.update(picked=picked, measured_winner=winner, agree=picked == winner)
    return out_row


def plot(rows: list[dict], drift_out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 6))
    sweep, extra = [r for r in rows if r["regime"] == "sweep"], [r for r in rows if r["regime"] != "sweep"]
    x = [r["generation_share"] for r in sweep]
    for name in rows[0]["vs_best_fixed"]:
        line = a.plot(x, [r["vs_best_fixed"][name] for r in sweep], marker="o", label=name)
        a.scatter([r["generation_share"] for r in extra], [r["vs_best_fixed"][name] for r in extra],
                  marker="s", facecolors="none", edgecolors=line[0].get_color())  # fmt: skip
    a.plot(x, [r["auto_vs_best_fixed"] for r in sweep], marker="*", color="k", lw=2, label="auto (steady)")
    for r in extra:  # the added regime: open squares, auto a black cross
        a.scatter([r["generation_share"]], [r["auto_vs_best_fixed"]], marker="X", color="k")
        a.annotate(f"added: {r['regime']}", (r["generation_share"], 0.05), fontsize=7, rotation=90)
    a.set(xlabel="generation share of a colocated step", ylabel="samples/s / best fixed", ylim=(0, 1.3))
    a.set_title("SIMULATION: regime sweep, 8 pretend devices")
    a.legend(
        fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3
    )  # below: clear of the added points
    names = ["best_at_start", "best_at_end"]
    b.bar([*names, "auto"], [drift_out[f"{n}_s"] for n in names] + [drift_out["auto_s"]])
    b.set(ylabel="seconds for the run", title="SIMULATION: response length grows 4x")
    pm = [(r["predicted_ms"][k], r["measured_ms"][k]) for r in rows for k in r["predicted_ms"]]
    pm = [(p, m) for p, m in pm if p != float("inf") and m != float("inf")]
    c.scatter([m for _, m in pm], [p for p, _ in pm], s=10)
    hi = max(max(p, m) for p, m in pm)
    c.plot([0, hi], [0, hi], "k--", lw=1)
    c.plot([0, hi], [0, 1.15 * hi], ":", color="grey", lw=1)
    c.plot([0, hi], [0, 0.85 * hi], ":", color="grey", lw=1)
    c.set(xlabel="measured ms/step", ylabel="predicted ms/step", title="SIMULATION: predicted vs measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8, help="pretend devices (a multiple of 4)")
    ap.add_argument("--points", type=int, default=9, help="regimes in the sweep")
    ap.add_argument(
        "--steps",
        type=int,
        default=14,
        help="auto runs 3x this; each fixed placement at least this, as many as auto's last plan ran",
    )
    ap.add_argument("--drift-steps", type=int, default=60)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=6,
        help="auto's profile window: each probe runs max(4, N/2) steps, a separated one a step more",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-placement")
    ap.add_argument("--real", type=int, default=0, metavar="ROUNDS", help="also run the real-compute check")
    ap.add_argument("--real-only", action="store_true", help="only the real-compute check")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    real = []
    for r in range(args.real or (1 if args.real_only else 0)):
        for workload, steps in (("tiny", 100), ("heavy", 24)):
            row = real_check(workload, steps, args.out)
            real.append(row)
            print(
                f"[placement] REAL {workload} round {r}: predicted colocate {row['sync']['predicted_s'] * 1e3:.0f} ms, "
                f"separate {row['async']['predicted_s'] * 1e3:.0f} ms; measured {row['sync']['measured_s'] * 1e3:.0f} / "
                f"{row['async']['measured_s'] * 1e3:.0f} ms; pick {row['picked']}, winner {row['measured_winner']}",
                flush=True,
            )
    if args.real_only:
        print(json.dumps({"bench": "placement", "simulated": False, "real": real}))
        return 0
    print(f"[placement] SIMULATION on {args.devices} pretend devices (placement/sim/engine.py)", flush=True)
    rows = []
    points = [("sweep", SAMPLES, *r, None) for r in regimes(args.points)] + EXTRA
    for i, (label, samples, prompt, response, tail, params) in enumerate(points):
        seed = args.seed + i
        row = sweep_point(
            args.devices, prompt, response, tail, args.steps, seed, args.profile_steps, samples, params
        )
        row["regime"] = label
        rows.append(row)
        fixed = "  ".join(
            f"{k.split()[0][:5]}{k.split()[-1][:5] if ' ' in k else ''}={v:.2f}"
            for k, v in row["vs_best_fixed"].items()
        )
        print(
            f"[placement] {label + ': ' if label != 'sweep' else ''}gen share {row['generation_share']:.2f}  "
            f"{row['params'] / 1e9:.1f}B B={samples} P={row['prompt_len']} R={row['response_len']} tail {row['tail']}  "
            f"auto={row['auto_vs_best_fixed']:.2f} pick={row['auto_pick_vs_best_fixed']:.2f} ({row['auto_plan']})  {fixed}",
            flush=True,
        )
    d = drift(args.devices, args.drift_steps, args.seed, args.profile_steps)
    print(
        f"[placement] drift (4x longer responses): best-at-start {d['best_at_start_s']:.2f} s, "
        f"best-at-end {d['best_at_end_s']:.2f} s, auto {d['auto_s']:.2f} s\n"
        f"[placement]   start: {d['best_at_start_plan']}; end: {d['best_at_end_plan']}; auto: {' -> '.join(d['auto_plans'])}"
    )
    errors = [
        abs(r["predicted_ms"][k] - r["measured_ms"][k]) / r["measured_ms"][k]
        for r in rows
        for k in r["predicted_ms"]
        if r["measured_ms"][k] != float("inf") and r["predicted_ms"][k] != float("inf")
    ] + [abs(r["auto_predicted_ms"] - r["auto_measured_ms"]) / r["auto_measured_ms"] for r in rows]
    worst_gap = {k: round(min(r["vs_best_fixed"][k] for r in rows), 3) for k in rows[0]["vs_best_fixed"]}
    plot(rows, d, args.out / "placement.png")
    summary = {
        "bench": "placement",
        "simulated": True,
        "devices": args.devices,
        "load_average": [round(v, 1) for v in os.getloadavg()],  # the phases sleep; wake-ups feel the load
        "extra_points": [e[0] for e in EXTRA],
        "auto_min_vs_best_fixed": min(r["auto_vs_best_fixed"] for r in rows),
        "auto_pick_min_vs_best_fixed": min(r["auto_pick_vs_best_fixed"] for r in rows),
        "auto_whole_run_min_vs_best_fixed": min(r["auto_whole_run_vs_best_fixed"] for r in rows),
        "fixed_worst_vs_best": worst_gap,
        "prediction_error_median": round(sorted(errors)[len(errors) // 2], 3),
        "prediction_error_max": round(max(errors), 3),
        "prediction_within_15pct": round(sum(e <= 0.15 for e in errors) / len(errors), 3),
        "drift": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()},
        "png": str(args.out / "placement.png"),
        "sweep": rows,
        "real": real,
    }
    print(
        f"[placement] SIMULATION: auto >= {summary['auto_min_vs_best_fixed']:.2f}x the best fixed at every point "
        f"in its own run, its pick >= {summary['auto_pick_min_vs_best_fixed']:.2f}x measured like the fixed ones; "
        f"each fixed placement's worst: {worst_gap}; prediction error median {summary['prediction_error_median']:.1%}, "
        f"max {summary['prediction_error_max']:.1%}"
    )
    print(json.dumps(summary, default=lambda v: None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
