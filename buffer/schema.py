"""Every record that crosses a process boundary, with its codec (docs/design.md §2).

Encoding is msgpack; numpy arrays travel as raw little-endian bytes plus dtype and shape (never per-element
lists, never pickle). :func:`decode_trajectory` and :func:`decode_prompt` are the only places that turn
bytes back into records, and they validate types, dtypes, shapes and sizes, raising :class:`SchemaError`
that names the field. The buffer moves entries that fail here to the dead-letter stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort")
# Largest array the decoder accepts (elements); larger ones are a corrupt or hostile entry.
MAX_TOKENS = 1 << 20


class SchemaError(ValueError):
    """A record that cannot be decoded; the message names the field."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass
class Trajectory:
    """One sampled response to one prompt, with what the learner needs to correct for staleness.

    Shapes: ``prompt_tokens`` (P,), ``response_tokens`` / ``behav_logp`` / ``token_versions`` (R,).
    ``behav_logp[i]`` is the engine's log-probability of ``response_tokens[i]`` under the distribution it
    actually sampled from; ``token_versions[i]`` is the policy version that produced it.
    """

    traj_id: str
    group_id: str
    prompt_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    behav_logp: np.ndarray
    token_versions: np.ndarray
    reward: float
    reward_parts: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    server_id: str = ""
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)
        self.response_tokens = np.ascontiguousarray(self.response_tokens, dtype=np.int32)
        self.behav_logp = np.ascontiguousarray(self.behav_logp, dtype=np.float32)
        self.token_versions = np.ascontiguousarray(self.token_versions, dtype=np.int32)

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced a token (staleness is measured from it)."""
        return (
            int(self.token_versions.min()) if len(self.token_versions) else int(self.meta.get("version", 0))
        )

    def staleness(self, learner_version: int) -> int:
        """``v - min(token_versions)`` at learner version ``v`` (docs/design.md §3.2)."""
        return learner_version - self.min_version


@dataclass
class PromptRecord:
    """A prompt queued for the rollout servers: its text, token ids and the dataset record (for rewards)."""

    prompt_id: str
    text: str
    tokens: np.ndarray
    record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)


# ------------------------------------------------------------------------------------------------ codec


def _pack_array(a: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(a)
    le = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    return [le.str, list(a.shape), a.astype(le, copy=False).tobytes()]


_ALLOWED_DTYPES = {"int32": "<i4", "float32": "<f4"}
_WIRE_DTYPES = {name: np.dtype(wire) for name, wire in _ALLOWED_DTYPES.items()}


def _unpack_array(name: str, packed: Any, dtype: str, max_len: int) -> np.ndarray:
    if not isinstance(packed, (list, tuple)) or len(packed) != 3:
        raise SchemaError(name, "expected [dtype, shape, bytes]")
    dt, shape, raw = packed
    if dt != _ALLOWED_DTYPES[dtype]:
        raise SchemaError(name, f"dtype {dt!r}, expected {dtype}")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 1
        or not isinstance(shape[0], int)
        or shape[0] < 0
    ):
        raise SchemaError(name, f"shape {shape!r}, expected one non-negative dimension")
    if shape[0] > max_len:
        raise SchemaError(name, f"{shape[0]} elements exceeds the limit of {max_len}")
    if not isinstance(raw, bytes) or len(raw) != shape[0] * 4:
        raise SchemaError(
            name, f"{len(raw) if isinstance(raw, bytes) else type(raw).__name__} bytes for shape {shape}"
        )
    # A copy: arrays over the message bytes would be read-only.
    return np.frombuffer(raw, dtype=_WIRE_DTYPES[dtype]).astype(dtype)


def _packb(record: dict[str, Any], free_form: str) -> bytes:
    """msgpack a record; only the free-form map (``meta`` / ``record``) can hold unpackable values."""
    try:
        return msgpack.packb(record, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(free_form, f"cannot be encoded ({type(e).__name__}: {e})") from None


def encode_trajectory(t: Trajectory) -> bytes:
    return _packb(
        {
            "v": SCHEMA_VERSION,
            "traj_id": t.traj_id,
            "group_id": t.group_id,
            "prompt_id": t.prompt_id,
            "prompt_tokens": _pack_array(t.prompt_tokens),
            "response_tokens": _pack_array(t.response_tokens),
            "behav_logp": _pack_array(t.behav_logp),
            "token_versions": _pack_array(t.token_versions),
            "reward": float(t.reward),
            "reward_parts": {str(k): float(v) for k, v in t.reward_parts.items()},
            "finish_reason": t.finish_reason,
            "server_id": t.server_id,
            "created_at": float(t.created_at),
            "meta": t.meta,
        },
        "meta",
    )


def _get(d: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    if name not in d:
        raise SchemaError(name, "missing")
    value = d[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SchemaError(name, "expected a number, got bool")
    if not isinstance(value, types):
        raise SchemaError(name, f"expected {getattr(types, '__name__', types)}, got {type(value).__name__}")
    return value


def _unpack_map(data: bytes, what: str) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(what, f"expected bytes, got {type(data).__name__}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise SchemaError(what, f"not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise SchemaError(what, f"expected a map, got {type(d).__name__}")
    if d.get("v") != SCHEMA_VERSION:
        raise SchemaError("v", f"schema version {d.get('v')!r}, expected {SCHEMA_VERSION}")
    return d


def decode_trajectory(data: bytes, max_tokens: int = MAX_TOKENS) -> Trajectory:
    """Bytes to a validated Trajectory, or SchemaError naming the first bad field."""
    d = _unpack_map(data, "trajectory")
    resp = _unpack_array("response_tokens", _get(d, "response_tokens", list), "int32", max_tokens)
    n = len(resp)
    behav = _unpack_array("behav_logp", _get(d, "behav_logp", list), "float32", max_tokens)
    versions = _unpack_array("token_versions", _get(d, "token_versions", list), "int32", max_tokens)
    for name, arr in (("behav_logp", behav), ("token_versions", versions)):
        if len(arr) != n:
            raise SchemaError(name, f"length {len(arr)} != len(response_tokens) {n}")
    if n and not (behav.min() > -np.inf and behav.max() <= 1e-4):  # NaN fails both comparisons
        raise SchemaError("behav_logp", "log-probabilities must be finite and <= 0")
    if n and versions.min() < 0:
        raise SchemaError("token_versions", "versions must be >= 0")
    prompt = _unpack_array("prompt_tokens", _get(d, "prompt_tokens", list), "int32", max_tokens)
    if len(prompt) == 0:
        raise SchemaError("prompt_tokens", "empty prompt (the first response token has nothing to follow)")
    for name, arr in (("prompt_tokens", prompt), ("response_tokens", resp)):
        if len(arr) and arr.min() < 0:
            raise SchemaError(name, f"negative token id {int(arr.min())}")
    finish = _get(d, "finish_reason", str)
    if finish not in FINISH_REASONS:
        raise SchemaError("finish_reason", f"{finish!r} not one of {FINISH_REASONS}")
    parts = _get(d, "reward_parts", dict)
    if not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in parts.items()
    ):
        raise SchemaError("reward_parts", "expected a map of str to finite number")
    reward = float(_get(d, "reward", (int, float)))
    if not np.isfinite(reward):
        raise SchemaError("reward", f"{reward} is not finite")
    return Trajectory(
        traj_id=_get(d, "traj_id", str),
        group_id=_get(d, "group_id", str),
        prompt_id=_get(d, "prompt_id", str),
        prompt_tokens=prompt,
        response_tokens=resp,
        behav_logp=behav,
        token_versions=versions,
        reward=reward,
        reward_parts={k: float(v) for k, v in parts.items()},
        finish_reason=finish,
        server_id=_get(d, "server_id", str),
        created_at=float(_get(d, "created_at", (int, float))),
        meta=_get(d, "meta", dict),
    )


def encode_prompt(p: PromptRecord) -> bytes:
    return _packb(
        {
            "v": SCHEMA_VERSION,
            "prompt_id": p.prompt_id,
            "text": p.text,
            "tokens": _pack_array(p.tokens),
            "record": p.record,
        },
        "record",
    )


def decode_prompt(data: bytes, max_tokens: int = MAX_TOKENS) -> PromptRecord:
    """Bytes to a validated PromptRecord, or SchemaError naming the first bad field."""
    d = _unpack_map(data, "prompt")
    tokens = _unpack_array("tokens", _get(d, "tokens", list), "int32", max_tokens)
    if len(tokens) == 0:
        raise SchemaError("tokens", "empty prompt")
    return PromptRecord(
        prompt_id=_get(d, "prompt_id", str),
        text=_get(d, "text", str),
        tokens=tokens,
        record=_get(d, "record", dict),
    )
