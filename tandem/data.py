"""The prompt dataset: JSONL records with a prompt field (and optional answer / metadata, and ``images``:
paths relative to the file or inline ``data:image/...;base64,`` strings, read by :mod:`tandem.vision`).

Loading validates every line up front and names the file and line of the first problem, so a broken
dataset fails before any process starts. A caller that sets bad records aside (``data.on_bad_record:
skip``) passes a list that collects them as :class:`Rejected` instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DatasetError(ValueError):
    """A problem in the prompt file, naming its line."""


@dataclass(frozen=True)
class Rejected:
    """A record set aside: its line in the file, why, and the line as it was (``rejected_prompts.jsonl``)."""

    line: int
    reason: str
    raw: str

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"


def read_jsonl(
    path: str | Path,
    what: str,
    error: type[ValueError] = DatasetError,
    *,
    rejected: list[Rejected] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each non-blank line of a JSONL file of objects; problems raise ``error``
    naming the file (as ``what``) and the line, or, given ``rejected``, a bad line is appended there."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p}: not found")
    out = []
    # Bytes that are not UTF-8 stay (as lone surrogates) so the line, not the whole file, is refused.
    with p.open(encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _record(line)
            except ValueError as e:
                if rejected is None:
                    raise error(f"{p}:{lineno}: {e}") from None
                rejected.append(Rejected(lineno, str(e), raw_text(line.rstrip("\n"))))
                continue
            out.append((lineno, rec))
    if not out:
        raise error(f"{what} {p}: no records" + (f" ({len(rejected)} set aside)" if rejected else ""))
    return out


def _record(line: str) -> dict[str, Any]:
    """One JSONL line as its object; ValueError says what is wrong with it."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:  # read with surrogateescape: the bytes that were not UTF-8
        raise ValueError(
            f"not valid UTF-8 (byte 0x{ord(line[e.start]) & 0xFF:02x} at character {e.start + 1})"
        ) from None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg}") from None
    if not isinstance(rec, dict):
        raise ValueError("a record must be a JSON object")
    return rec


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded (a lone surrogate, which JSON's ``\\ud800`` escapes can make), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate {text[e.start]!a} at character {e.start + 1}"
    return None


def raw_text(line: str) -> str:
    """A line read with ``surrogateescape`` as text that can be written back: bytes that were not UTF-8 as
    ``\\xNN`` escapes."""
    return line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def prompt_records(
    path: str | Path, prompt_field: str = "prompt", *, rejected: list[Rejected] | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of a JSONL prompt file, checked. Each record gets an ``id`` (its line
    number when absent). Bad records raise DatasetError naming the first one's line or, given
    ``rejected``, go there."""
    p = Path(path)
    bad: list[Rejected] = []
    records = []
    for lineno, rec in read_jsonl(p, "prompt file", rejected=bad):
        text = rec.get(prompt_field)
        if not isinstance(text, str) or not text:
            bad.append(Rejected(lineno, f"field {prompt_field!r} must be a non-empty string", ""))
        elif problem := unicode_problem(text):
            bad.append(Rejected(lineno, f"field {prompt_field!r} is not valid text: {problem}", ""))
        elif "images" in rec and (problem := _images_problem(rec["images"], p.parent)):
            bad.append(Rejected(lineno, problem, ""))
        else:
            rec.setdefault("id", f"{p.stem}-{lineno}")
            records.append((lineno, rec))
    bad.sort(key=lambda r: r.line)
    if bad and rejected is None:
        raise DatasetError(f"{p}:{bad[0].line}: {bad[0].reason}")
    if rejected is not None:
        rejected += [r if r.raw else Rejected(r.line, r.reason, raw_line(p, r.line)) for r in bad]
    if not records:
        raise DatasetError(f"prompt file {p}: no usable records ({len(bad)} set aside)")
    return records


def _images_problem(value: Any, base: Path) -> str | None:
    # PIL only for a dataset with images: the launcher imports this module.
    from tandem.vision import images_problem

    return images_problem(value, base)


def load_prompts(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Read and check a JSONL prompt file. Each record gets an ``id`` (its line number when absent)."""
    return [rec for _, rec in prompt_records(path, prompt_field)]


def raw_line(path: str | Path, lineno: int) -> str:
    """Line ``lineno`` (from 1) of a file, as :func:`raw_text` writes it: for a record set aside."""
    with Path(path).open(encoding="utf-8", errors="surrogateescape") as f:
        for i, line in enumerate(f, 1):
            if i == lineno:
                return raw_text(line.rstrip("\n"))
    return ""


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


def model_limits(checkpoint: str | Path) -> tuple[int | None, int | None]:
    """``(vocab_size, max_position_embeddings)`` from a checkpoint's config.json (a multimodal model's
    ``text_config`` when the top level lacks them); None for what it does not say or cannot be read."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(config, dict):
        return None, None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def value(key: str) -> int | None:
        v = config.get(key, text.get(key))
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return value("vocab_size"), value("max_position_embeddings")


def prompt_screen(
    checkpoint: str | Path, max_prompt_tokens: int, vocab_fallback: int | None = None
) -> Callable[[Any], tuple[str, str] | None]:
    """What a rollout server checks in each prompt record it takes from Redis (a record the feeder did not
    write, or one written against another model): ids inside the model's vocabulary, a length within
    ``max_prompt_tokens`` and the model's context. The screen answers ``("dead", reason)`` for a bad
    record (it is dead-lettered, never generated) and None for a good one."""
    vocab, context = model_limits(checkpoint)
    vocab = vocab or vocab_fallback
    longest = min(max_prompt_tokens, context or max_prompt_tokens)

    def screen(record: Any) -> tuple[str, str] | None:
        tokens = record.tokens
        if len(tokens) > longest:
            return (
                "dead",
                f"{len(tokens)} prompt tokens > {longest} (data.max_prompt_tokens, the model's context)",
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or (vocab is not None and high >= vocab):
            return "dead", f"token ids {low}..{high} outside the vocabulary [0, {vocab})"
        return None

    return screen
