"""The prompt dataset: JSONL records with a prompt field (and optional answer / metadata).

Loading validates every line up front and names the file and line of the first problem, so a broken
dataset fails before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A problem in the prompt file, naming its line."""


def load_prompts(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Read and check a JSONL prompt file. Each record gets an ``id`` (its line number when absent)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"prompt file {p}: not found")
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not valid JSON: {e.msg}") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"{p}:{lineno}: a record must be a JSON object")
            if not isinstance(rec.get(prompt_field), str) or not rec[prompt_field]:
                raise DatasetError(f"{p}:{lineno}: field {prompt_field!r} must be a non-empty string")
            rec.setdefault("id", f"{p.stem}-{lineno}")
            records.append(rec)
    if not records:
        raise DatasetError(f"prompt file {p}: no records")
    return records


def write_prompts(path: str | Path, records: list[dict[str, Any]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p
