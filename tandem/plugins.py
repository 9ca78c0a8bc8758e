"""Every plug-in a config names, imported and checked before any process starts.

A config names user code by dotted path (``module:function`` or ``module:Class``): reward functions, an
environment, an agent, and in a pipeline a judge and a gold scorer. The server or learner that calls it
imports it only once it has started, so a typo there would fail late and again on every restart.
:func:`check_plugins` imports each one in the launching process and, where the call is known, checks the
arguments it will be called with bind to its signature. It is called by ``python -m tandem check-config``,
``launch.py`` (with or without ``--dry-run``) and ``launch.py pipeline``; it is not part of the config's
validation, so loading a config never imports user code.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from tandem.config import Config, ConfigError

__all__ = ["check_callable", "check_pipeline_plugins", "check_plugins", "require"]

_REWARD_CALL = "(prompt, completion, record)"
_GROUP_CALL = "(prompt, completions, record)"


def check_callable(
    field: str, path: str, args: tuple[Any, ...], kwargs: dict[str, Any], call: str
) -> str | None:
    """Import ``path`` (``module:attr``) and check ``attr(*args, **kwargs)`` binds to its signature; the
    problem as one line starting with ``field``, or None when there is none."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import that fails in any way fails the same in every server
        return f"{field}: cannot import {module_name!r}: {e}"
    fn = getattr(module, attr, None)
    if fn is None:
        return f"{field}: module {module_name!r} has no attribute {attr!r}"
    if not callable(fn):
        return f"{field}: {path} is not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to check
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return f"{field}: {path}{sig} cannot be called as {attr}{call}: {e}"
    return None


def _reward(field: str, path: str, kwargs: dict[str, Any] | None = None) -> str | None:
    return check_callable(field, path, (None, None, None), kwargs or {}, _REWARD_CALL)


def check_plugins(cfg: Config) -> list[str]:
    """One line per plug-in of ``cfg`` that cannot be imported or called as tandem calls it (empty: all
    good). Reward functions are called ``fn(prompt, completion, record, **kwargs)``, group reward functions
    ``fn(prompt, completions, record, **kwargs)``; ``env.path`` as
    ``factory(**env.kwargs)``; ``agent.path`` as ``agent(client, record, model=..., **agent.kwargs)``."""
    errors: list[str] = []
    for i, f in enumerate(cfg.reward.functions):
        errors.append(_reward(f"reward.functions[{i}].path", f.path, f.kwargs))
    for i, f in enumerate(cfg.reward.group_functions):
        field = f"reward.group_functions[{i}].path"
        errors.append(check_callable(field, f.path, (None, None, None), f.kwargs, _GROUP_CALL))
    if cfg.env.path is not None:
        kw = dict(cfg.env.kwargs)
        call = "(" + ", ".join(f"{k}=..." for k in kw) + ")"
        errors.append(check_callable("env.path", cfg.env.path, (), kw, call))
    if cfg.agent.path is not None:
        kw = {"model": None, **cfg.agent.kwargs}
        call = "(client, record, " + ", ".join(f"{k}=..." for k in kw) + ")"
        errors.append(check_callable("agent.path", cfg.agent.path, (None, None), kw, call))
    return [e for e in errors if e is not None]


def check_pipeline_plugins(pc: Any) -> list[str]:
    """The same for a pipeline config (stages/pipeline_config.py): ``score.rule`` and ``pairs.judge``,
    both called like reward functions. The stages' own configs are checked with :func:`check_plugins`."""
    checks: list[tuple[str, str]] = []
    if pc.score is not None:
        checks.append(("score.rule", pc.score.rule))
    if pc.pairs.judge is not None:
        checks.append(("pairs.judge", pc.pairs.judge))
    return [e for field, path in checks if (e := _reward(field, path)) is not None]


def require(errors: list[str]) -> None:
    """Raise one ConfigError holding every problem, one per line, when there is any."""
    if errors:
        raise ConfigError("\nerror: ".join(errors))
