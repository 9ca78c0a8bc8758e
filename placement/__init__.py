"""Placement of a run's models on its devices: plans, the cost model, the planner, and a simulator.

- ``placement/plans.py``: what a plan is, and every candidate on N devices;
- ``placement/cost.py``: per-role laws fitted to measured phase times, a plan's predicted step and memory;
- ``placement/planner.py``: the exhaustive ranking and hysteresis-gated re-planning;
- ``placement/sim/``: SIMULATION of devices (locks, memory counters) for what two CPU cores cannot show:
  the simulated run (``engine.py``), its ground truth (``truth.py``) and ``placement.mode: auto`` on it
  (``auto.py``); used by bench/ and tests only, never by a run;
- ``placement/configured.py``: what a plan means for a run on this backend (threads on CPU, devices on CUDA).

docs/placement.md §11 describes the whole.
"""
