"""The foundation every other package builds on (docs/design.md §1.9, layer 0): the run configuration
(``config/``), telemetry and timers, prompt files, reward plug-in loading, the log-probability math both
sides share, networking and child-process utilities, DeepSpeed's prebuilt CPU ops, the rollout fleet's
membership, and ``python -m tandem`` (config checks and reference). It imports no other package of the
project.
"""
