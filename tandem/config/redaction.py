"""The config on its way out of the process: as YAML for the run directory and child processes, written
for its owner only, and its public form with every secret (URL passwords, API keys) redacted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from tandem.config.root import Config

# user:password@ (or :password@) in any URL, e.g. redis://:secret@host:6379/0.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s]*):[^@/\s]+@")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced, for logs and error messages."""
    return _URL_CREDENTIALS.sub(rf"\g<scheme>\g<user>:{REDACTED}@", text)


def public_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data with every secret (URL passwords, API keys) redacted: what wandb records."""
    data = cfg.model_dump(mode="json")
    if data["redis"]["url"] is not None:
        data["redis"]["url"] = redact(data["redis"]["url"])
    for section in (data["rollout"]["http"], data["rollout"]["vllm"], data["rollout"]["sglang"]):
        if section.get("api_key") is not None:
            section["api_key"] = REDACTED
    return data


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into the run directory and passed to child processes)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def dump_public_config(cfg: Config) -> str:
    """The config as YAML with every secret redacted: what ``--dry-run`` prints."""
    return yaml.safe_dump(public_dict(cfg), sort_keys=False)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` for its owner only (mode 0600 from creation on: it holds a secret, a
    Redis password), atomically: a reader sees the old file or the whole new one, never half a secret."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: a leftover must not lend its mode
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)
