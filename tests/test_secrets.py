"""No secret reaches a log line, an error message or wandb: Redis URL passwords and API keys are redacted."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from tandem.config import load_config, public_dict, redact
from tandem.telemetry import RedactSecrets, Telemetry, setup_logging

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-Pa55word"


def test_redact_hides_only_the_password() -> None:
    assert redact(f"redis://:{SECRET}@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert (
        redact(f"at rediss://user:{SECRET}@h:1 and redis://:x@y:2")
        == "at rediss://user:***@h:1 and redis://:***@y:2"
    )
    assert (
        redact("redis://127.0.0.1:6379/0 http://host:8000/v1")
        == "redis://127.0.0.1:6379/0 http://host:8000/v1"
    )


def test_every_log_line_is_redacted_whoever_logs_it() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactSecrets())
    lib = logging.getLogger("some.library")
    lib.addHandler(handler)
    try:
        lib.warning("connecting to %s", f"redis://:{SECRET}@127.0.0.1:6379")
        lib.warning(f"retrying redis://:{SECRET}@127.0.0.1:6379 (attempt %d)", 2)
    finally:
        lib.removeHandler(handler)
    out = stream.getvalue()
    assert SECRET not in out
    assert "redis://:***@127.0.0.1:6379" in out and "(attempt 2)" in out


def test_setup_logging_installs_the_filter_on_the_root_handlers() -> None:
    setup_logging("INFO")
    assert all(any(isinstance(f, RedactSecrets) for f in h.filters) for h in logging.getLogger().handlers)


def test_wandb_records_no_secret(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"redis.url=redis://:{SECRET}@127.0.0.1:1/0",
            f"rollout.http.api_key={SECRET}",
            "logging.wandb_mode=offline",
        ],
    )
    assert SECRET not in str(public_dict(cfg))
    assert public_dict(cfg)["redis"]["url"] == "redis://:***@127.0.0.1:1/0"
    telemetry = Telemetry(cfg, "learner", run_dir=str(tmp_path))
    telemetry.log({"reward/mean": 0.5}, step=1)
    telemetry.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written  # wandb wrote its offline run here
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
