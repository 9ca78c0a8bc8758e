"""Offline datasets: JSONL records of the documented schemas (docs/stages.md §2), tokenised and checked at load.

Two shapes, each accepted as plain text or as chat messages:

- **Demonstrations** (sft): ``{"prompt": str, "response": str}``, or ``{"messages": [{"role", "content"},
  ...]}`` whose last message is the assistant's response and whose earlier ones go through the chat
  template as the prompt. The response gets the tokenizer's end-of-sequence token appended, so the model
  learns to stop. For a vision-language model a ``prompt`` record may carry ``"images"`` (paths relative to
  the file, or ``data:image/...;base64,`` URLs, as prompt files do: docs/design.md §8.4): the user turn
  holds them before the text, and the row carries their pixels.
- **Preference pairs** (rm, dpo): ``{"prompt": str, "chosen": str, "rejected": str}``; ``prompt`` may also
  be a list of chat messages.

Every record is tokenised once, up front; a bad record fails the load naming the file, the line and the
field, before any model is built. Examples become :class:`buffer.schema.Trajectory` rows so the learner's
batch machinery (``learner/batch.py``: pad/pack layouts, response views, rank splits) serves every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from buffer.schema import Trajectory
from tandem.data import chat_token_ids, read_jsonl
from tandem.vision import ImageError, VisionInputs, VisionProcessor, load_image


class ExampleError(ValueError):
    """A problem in an offline dataset, naming its file, line and field."""


@dataclass
class Demonstration:
    prompt: list[int]
    response: list[int]  # ends with EOS
    vision: VisionInputs | None = None  # the prompt's images, for a vision-language model


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    prompt_text: str  # the reward model scores prompt text + response text, as the rollout server does
    chosen_text: str
    rejected_text: str


def _records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each line: ``where`` is ``path:line``, for the errors that name it."""
    return [(f"{path}:{lineno}", rec) for lineno, rec in read_jsonl(path, "dataset", ExampleError)]


def _text(rec: dict[str, Any], key: str, where: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value:
        raise ExampleError(f"{where}: field {key!r} must be a non-empty string")
    return value


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise ExampleError(f"{where}: field {key!r} must be a non-empty list of {{role, content}} messages")
    return value


def _prompt_ids(tokenizer: Any, prompt: Any, where: str, *, chat_template: bool) -> tuple[list[int], str]:
    """Token ids and the text the reward model sees for a prompt given as text or as chat messages."""
    if isinstance(prompt, list):
        messages = _messages(prompt, where, "prompt")
        ids = chat_token_ids(tokenizer, messages)
        return ids, tokenizer.decode(ids)
    if not isinstance(prompt, str) or not prompt:
        raise ExampleError(f"{where}: field 'prompt' must be a non-empty string or a list of messages")
    if chat_template:
        ids = chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
        return ids, tokenizer.decode(ids)
    return [int(t) for t in tokenizer(prompt)["input_ids"]], prompt


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text)["input_ids"]]


def _check_length(n: int, max_tokens: int, where: str) -> None:
    if n > max_tokens:
        raise ExampleError(f"{where}: {n} tokens, more than algorithm.max_tokens={max_tokens}")


def _image_prompt(
    rec: dict[str, Any], where: str, base: Path, vision: VisionProcessor | None, *, chat_template: bool
) -> tuple[list[int], VisionInputs]:
    """A ``prompt`` record with ``images``: its token ids (placeholders expanded) and pixels."""
    if vision is None:
        raise ExampleError(f"{where}: field 'images': the model is not a vision-language checkpoint")
    if "messages" in rec:
        raise ExampleError(f"{where}: field 'images' goes with a 'prompt' record, not 'messages'")
    entries = rec["images"]
    if not isinstance(entries, list) or not entries:
        raise ExampleError(f"{where}: field 'images' must be a non-empty list of paths or data URLs")
    try:
        images = [load_image(e, base) for e in entries]
        return vision.encode(_text(rec, "prompt", where), images, chat_template=chat_template)
    except (ImageError, ValueError) as e:
        raise ExampleError(f"{where}: field 'images': {e}") from None


def load_demonstrations(
    path: str | Path,
    tokenizer: Any,
    *,
    max_tokens: int,
    chat_template: bool = False,
    vision: VisionProcessor | None = None,
) -> list[Demonstration]:
    """``vision``: the model's processor when it is a vision-language model (records may carry images)."""
    eos = tokenizer.eos_token_id
    out = []
    for where, rec in _records(path):
        if "images" in rec:
            prompt, pixels = _image_prompt(rec, where, Path(path).parent, vision, chat_template=chat_template)
            response = [*_ids(tokenizer, _text(rec, "response", where)), eos]
            _check_length(len(prompt) + len(response), max_tokens, where)
            out.append(Demonstration(prompt, response, pixels))
            continue
        if "messages" in rec:
            messages = _messages(rec["messages"], where, "messages")
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise ExampleError(f"{where}: 'messages' must end with an assistant turn after a prompt")
            prompt = chat_token_ids(tokenizer, messages[:-1])
            response = [*_ids(tokenizer, messages[-1]["content"]), eos]
        else:
            prompt, _ = _prompt_ids(tokenizer, rec.get("prompt"), where, chat_template=chat_template)
            response = [*_ids(tokenizer, _text(rec, "response", where)), eos]
        _check_length(len(prompt) + len(response), max_tokens, where)
        out.append(Demonstration(prompt, response))
    return out


def load_pairs(
    path: str | Path, tokenizer: Any, *, max_tokens: int, chat_template: bool = False
) -> list[Pair]:
    eos = tokenizer.eos_token_id
    out = []
    for where, rec in _records(path):
        prompt, prompt_text = _prompt_ids(tokenizer, rec.get("prompt"), where, chat_template=chat_template)
        chosen, rejected = _text(rec, "chosen", where), _text(rec, "rejected", where)
        pair = Pair(
            prompt,
            [*_ids(tokenizer, chosen), eos],
            [*_ids(tokenizer, rejected), eos],
            prompt_text,
            chosen,
            rejected,
        )
        _check_length(len(prompt) + max(len(pair.chosen), len(pair.rejected)), max_tokens, where)
        out.append(pair)
    return out


def as_trajectory(
    prompt: list[int], response: list[int], key: str, vision: VisionInputs | None = None
) -> Trajectory:
    """An example as a batch row: its response tokens are the ones a loss or a score reads; ``vision``, the
    prompt's images."""
    r = len(response)
    return Trajectory(
        traj_id=key,
        group_id=key,
        prompt_id=key,
        prompt_tokens=np.asarray(prompt),
        response_tokens=np.asarray(response),
        behav_logp=np.zeros(r, dtype=np.float32),
        token_versions=np.zeros(r, dtype=np.int32),
        reward=0.0,
        **(vision.arrays() if vision is not None else {}),
    )
