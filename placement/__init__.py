"""Placement of a run's models on its devices: plans, the cost model, the planner, and a simulator.

- ``placement/plans.py``: what a plan is, and every candidate on N devices;
- ``placement/cost.py``: per-role laws fitted to measured phase times, a plan's predicted step and memory;
- ``placement/planner.py``: the exhaustive ranking and hysteresis-gated re-planning;
- ``placement/sim.py``: SIMULATION of devices (locks, memory counters) for what two CPU cores cannot show,
  with its ground truth in ``placement/sim_truth.py`` and ``placement.mode: auto`` on it in
  ``placement/sim_auto.py``;
- ``placement/configured.py``: what a plan means for a run on this backend (threads on CPU, devices on CUDA).

docs/design.md §11 describes the whole.
"""
