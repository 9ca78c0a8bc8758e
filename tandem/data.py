"""The prompt dataset: JSONL records with a prompt field (and optional answer / metadata).

Loading validates every line up front and names the file and line of the first problem, so a broken
dataset fails before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DatasetError(ValueError):
    """A problem in the prompt file, naming its line."""


def read_jsonl(
    path: str | Path, what: str, error: type[ValueError] = DatasetError
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each non-blank line of a JSONL file of objects; problems raise ``error``
    naming the file (as ``what``) and the line."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p}: not found")
    out = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{p}:{lineno}: not valid JSON: {e.msg}") from None
            if not isinstance(rec, dict):
                raise error(f"{p}:{lineno}: a record must be a JSON object")
            out.append((lineno, rec))
    if not out:
        raise error(f"{what} {p}: no records")
    return out


def load_prompts(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Read and check a JSONL prompt file. Each record gets an ``id`` (its line number when absent)."""
    p = Path(path)
    records = []
    for lineno, rec in read_jsonl(p, "prompt file"):
        if not isinstance(rec.get(prompt_field), str) or not rec[prompt_field]:
            raise DatasetError(f"{p}:{lineno}: field {prompt_field!r} must be a non-empty string")
        rec.setdefault("id", f"{p.stem}-{lineno}")
        records.append(rec)
    return records


def write_prompts(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Write ``records`` as JSONL, one object a line (prompts, demonstrations, preferences), making its folder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the generation prompt.

    ``return_dict=True`` pins the return type: transformers 5 returns a ``BatchEncoding`` for
    ``tokenize=True`` where 4.x returned a list, and iterating that yields its keys, not token ids.
    """
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in encoded["input_ids"]]


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, text: str, *, chat_template: bool) -> list[int]:
    """A dataset prompt as token ids: as a user turn of the chat template, or tokenised as it is."""
    if chat_template:
        return chat_token_ids(tokenizer, [{"role": "user", "content": text}])
    return [int(t) for t in tokenizer(text)["input_ids"]]
