"""The pipeline's SFT + reward-model part under each schedule: serial, parallel, auto (docs/stages.md §4.5).

    python bench/stage_schedule.py [--config configs/pipeline-parallel-tiny.yaml] [--rounds 2]
                                   [--out runs/bench-stage-schedule] [key=value ...]

Each round runs the sft and rm stages of the config from scratch under every schedule in turn (rounds
rotate the order, so a load that drifts during a round does not favour one schedule), with no task scoring
and no PPO. Serial is each stage alone with every core, one after the other; parallel, both at once on an
even split; auto, its profile window, then the plan it picks. Wall seconds are the children's, data
generation excluded. For auto, the planner's predicted seconds for its plan beside the measured ones (the
profile window is extra: measured, never predicted). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import schedule
from stages.pipeline import Pipeline
from stages.pipeline_config import load_pipeline

MODES = ("serial", "parallel", "auto")


def run_once(config: str, mode: str, out: Path, overrides: list[str]) -> dict[str, float]:
    extra = [f"output_dir={out}", f"name=bench-{mode}", f"schedule={mode}", "score=null", "monitor=null"]
    p = Pipeline(load_pipeline(config, [*overrides, *extra]))
    shutil.rmtree(p.dir, ignore_errors=True)
    cfgs = p.stage_configs()
    p.dir.mkdir(parents=True)
    p.make_data()
    cores = p.pc.split.cores or os.cpu_count() or 1
    t0 = time.time()
    if mode == "serial":  # the pipeline's serial loop, without what it does around the children
        for stage in schedule.OFFLINE:
            (p.dir / stage).mkdir()
            schedule.run_together([schedule.Job(stage, p.offline_cmd(stage, cfgs[stage]), p.dir / stage / "train.log", cores)])  # fmt: skip
        return {"wall_s": time.time() - t0}
    schedule.run_offline_stages(p, cfgs)
    rec = json.loads((p.dir / "schedule.json").read_text())
    row = {"wall_s": rec["total_s"], "plan": rec.get("plan")}
    if mode == "auto":
        row.update(profile_s=rec["profile_s"], predicted_s=rec["predicted_s"], measured_s=rec["measured_s"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/pipeline-parallel-tiny.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/bench-stage-schedule")
    ap.add_argument("overrides", nargs="*", help="key.sub=value over the pipeline config")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            row = run_once(args.config, mode, Path(args.out).resolve(), args.overrides)
            rows[mode].append(row)
            print(f"round {r} {mode:8s} " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)  # fmt: skip
    out = {
        "config": args.config,
        "overrides": args.overrides,
        "cores": os.cpu_count(),
        "load_before": load,
        "load_after": os.getloadavg()[0],
        **{f"{m}_s": statistics.median(x["wall_s"] for x in rows[m]) for m in MODES},
        "auto_plans": [x["plan"] for x in rows["auto"]],
        "auto_profile_s": statistics.median(x["profile_s"] for x in rows["auto"]),
        "auto_predicted_s": statistics.median(x["predicted_s"] for x in rows["auto"]),
        "auto_measured_s": statistics.median(x["measured_s"] for x in rows["auto"]),
        "rounds": args.rounds,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
