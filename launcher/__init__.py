"""The launcher behind ``launch.py``: one run of tandem, whatever runs its processes (docs/design.md §1.5).

- ``run_plan.py``: the run plan — its roles (the learner and the rollout servers), their entry points,
  resources, restart policy and readiness — computed from the config alone;
- ``feeder.py``: the prompt set and the feeder that keeps the prompt stream topped up;
- ``console.py``: the live progress line and the end-of-run summary;
- ``driver.py``: a run top to bottom (run dir, Redis, feeder, start, wait ready, supervise, shutdown);
- ``backends/``: what starts and watches the roles' processes — ``local`` (subprocesses on this machine,
  the default, no Ray needed) and ``ray`` (Ray actors on a cluster). A new backend is one new module
  there (docs/design.md §1.7).
"""
