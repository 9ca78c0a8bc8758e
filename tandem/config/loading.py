"""From a YAML file and ``key.sub=value`` overrides to a validated :class:`Config`: reading, overriding,
validating, and pydantic's errors rewritten as the user wrote the config (one line per field path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tandem.config.algorithm import RECIPES
from tandem.config.base import ConfigError, SectionCheckError
from tandem.config.root import Config


def format_validation_error(err: ValidationError, source: str) -> str:
    """pydantic's errors as the user wrote the config: one line per field (its dotted path, the reason
    and the value given), under a head naming ``source``. Every config loader raises it as ConfigError."""
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc[:1] == ["algorithm"] and len(loc) > 1 and loc[1] in RECIPES:
            del loc[1]  # the union's tag: the user wrote algorithm.x, not algorithm.ppo.x
        path = ".".join(str(p) for p in loc) or "<root>"
        msg = e["msg"]
        if e["type"] == "union_tag_invalid":  # the discriminator names its own field
            path, msg = (
                f"{path}.recipe",
                f"unknown recipe {e['ctx']['tag']!r}; choose from {e['ctx']['expected_tags']}",
            )
            lines.append(f"{path}: {msg}")
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        shown = (
            "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        )
        if not e["loc"] or isinstance(e.get("ctx", {}).get("error"), SectionCheckError):
            # a check across fields: its message starts with the field it names
            lines.append(msg.removeprefix("Value error, "))
            continue
        lines.append(f"{path}: {msg}{shown}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def _parse_scalar(text: str) -> Any:
    """An override value is parsed as YAML so `x=3`, `x=0.5`, `x=true`, `x=null`, `x=[a,b]` all work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (before validation)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        node = raw
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
    return raw


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    raw: dict[str, Any] | None = None,
) -> Config:
    """Load, override and validate a config. Raises ConfigError naming the field and reason.

    Relative paths in ``model`` and ``data`` are resolved against the current directory (where launch.py
    runs), so the shipped configs work from the repo root.
    """
    source = str(path) if path is not None else "<dict>"
    if raw is None:
        if path is None:
            raise ConfigError("no config file given")
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source}: not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {source}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source}: top level must be a mapping of sections")
    raw = apply_overrides(_deepcopy(raw), list(overrides))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    return cfg.resolve_paths(Path.cwd())


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d
