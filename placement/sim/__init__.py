"""SIMULATION: the placement simulator, used by bench/ and tests only; the runtime never imports it.

Pretend devices are locks and memory counters, and each phase sleeps for what a ground truth says it costs,
so placements a two-core machine cannot run can still be measured against the planner's predictions
(docs/placement.md §11.4):

- ``engine.py``: the cluster of pretend devices and one simulated run of a plan (:class:`engine.SimRun`);
- ``truth.py``: the ground truth, what each phase costs and how much memory it holds, richer than the
  planner's laws;
- ``auto.py``: ``placement.mode: auto`` on a simulated run: probe plans, a fit, a pick, and re-planning.

tests/test_layers.py checks that no runtime module imports this package.
"""
