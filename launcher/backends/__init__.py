"""Backends: what starts a run plan's processes, watches them and stops them (docs/design.md §1.7).

A backend is one module here exposing ``make(address: str | None) -> Backend``; ``launch.py --backend
NAME`` imports ``launcher.backends.NAME`` only when asked, so ``local`` never imports Ray. Everything
else — the run directory, Redis, the prompt feeder, readiness through Redis, the console, the summary —
is the driver's (``launcher/driver.py``) and the same for every backend.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Protocol

import redis

from launcher.run_plan import RunPlan
from tandem.config import Config, ConfigError


@dataclass
class Outcome:
    ok: bool
    message: str
    moved: bool = False  # stopped cleanly to continue under another placement (a re-plan)


class StartError(RuntimeError):
    """A backend could not start the plan (e.g. not scheduled in time); the run ends with this message."""


class Backend(Protocol):
    name: str

    def prepare(self, cfg: Config) -> Config:
        """Before anything starts: connect, check the plan fits (ConfigError naming the shortfall)."""

    def redis_host(self) -> str:
        """The address an embedded Redis binds to: one every process of the run can reach."""

    def describe(self, plan: RunPlan) -> list[str]:
        """``--dry-run``: one block of text per role (how it would be started)."""

    def start(self, plan: RunPlan, client: redis.Redis, config_text: str) -> None:
        """Start every role. ``config_text`` is the per-process config (also at ``plan.config_path``)."""

    def poll(self, stopping: bool) -> Outcome | None:
        """One supervision tick, from start-up on: restart crashed processes per their role's policy
        (``launcher/supervision.py``); an Outcome once the run is over or a role is past its limit."""

    def placement(self) -> dict[str, str]:
        """Where each process runs now (process name → node), for the summary."""

    def stop(self, grace_s: float) -> None:
        """After ``{run}:stop`` is set: wait up to ``grace_s`` for clean exits, then force; nothing left."""

    def close(self) -> None:
        """Release what ``prepare`` took (a cluster connection); called once at the very end."""


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__))


def get_backend(name: str, address: str | None = None) -> Backend:
    if name not in available():
        raise ConfigError(f"--backend: no backend {name!r} (have: {', '.join(available())})")
    return importlib.import_module(f"launcher.backends.{name}").make(address)
