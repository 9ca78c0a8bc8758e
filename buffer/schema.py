"""Every record that crosses a process boundary, with its codec (docs/design.md §2).

Encoding is msgpack; numpy arrays travel as raw little-endian bytes plus dtype and shape (never per-element
lists, never pickle). Every record carries its schema version ``v``: version 2 added the trajectory's
``loss_mask`` (multi-turn episodes, docs/environments.md §10.1); a version-1 trajectory still decodes, as the
single-turn episode it was (every response token generated). Any other version is refused naming ``v``.
A trajectory's ``ref_logp`` is an optional key: present only when a rollout server scored the reference
(``placement.reference: server``), so records without it, older ones included, decode as before; so is
``routed_experts``, present only when the engine recorded its MoE routing (``algorithm.routing_replay``),
and ``pixel_values`` with ``image_grid_thw``, present only for a vision-language prompt with images.
:func:`decode_trajectory` and :func:`decode_prompt` are the only places that turn bytes back into records, and they validate types, dtypes, shapes and sizes, raising :class:`SchemaError`
that names the field. The buffer moves entries that fail here to the dead-letter stream.
:class:`Turns` is how every producer builds a trajectory's response, a turn at a time.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 2
DECODABLE_VERSIONS = (1, 2)  # v1: no loss_mask (single turn)
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
    """One episode: a prompt and what followed it, with what the learner needs to correct for staleness.

    Shapes: ``prompt_tokens`` (P,), ``response_tokens`` / ``behav_logp`` / ``token_versions`` /
    ``loss_mask`` (R,). A single-turn trajectory's response is one model turn. A multi-turn one is the
    segments after the prompt in order, model turn, environment turn, model turn, ..., as one token sequence
    (docs/environments.md §10.1); ``loss_mask[i]`` is 1 where the model generated ``response_tokens[i]`` and 0 where
    the environment wrote it (context, never trained on). On generated tokens ``behav_logp[i]`` is the
    engine's log-probability of the token under the distribution it actually sampled from and
    ``token_versions[i]`` the policy version that produced it; on environment tokens they are 0 and −1.
    ``ref_logp`` (R,), when a rollout server scored the frozen reference (``placement.reference: server``),
    is log π_ref of each generated token at the sampling temperature, 0 on environment tokens.
    ``routed_experts`` (P + R − 1, layers, k), when the engine recorded it (``algorithm.routing_replay``),
    is the expert indices each MoE layer's router chose for each position the engine fed (the prompt, then
    every response token but the last, which is never fed); uint8, or int32 above 256 experts.
    ``pixel_values`` (patches, dim) float32 and ``image_grid_thw`` (images, 3) int32, for a prompt with
    images on a vision-language model, are the processor outputs the engine generated from
    (tandem/vision.py), so the learner's forward sees the same pixels; ``prompt_tokens`` then hold the
    expanded image placeholders. Each of a group's samples carries its own copy.
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
    loss_mask: np.ndarray | None = None  # None: every response token was generated (single turn)
    ref_logp: np.ndarray | None = None  # None: the learner scores the reference itself (or there is none)
    routed_experts: np.ndarray | None = None  # None: no routing recorded (dense model, or replay off)
    pixel_values: np.ndarray | None = None  # None: a text prompt (both image fields or neither)
    image_grid_thw: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)
        self.response_tokens = np.ascontiguousarray(self.response_tokens, dtype=np.int32)
        self.behav_logp = np.ascontiguousarray(self.behav_logp, dtype=np.float32)
        self.token_versions = np.ascontiguousarray(self.token_versions, dtype=np.int32)
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.response_tokens), dtype=np.uint8)
        self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=np.uint8)
        if self.ref_logp is not None:
            self.ref_logp = np.ascontiguousarray(self.ref_logp, dtype=np.float32)
        if self.routed_experts is not None:
            self.routed_experts = np.ascontiguousarray(self.routed_experts)
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw come together")
        if self.pixel_values is not None:
            self.pixel_values = np.ascontiguousarray(self.pixel_values, dtype=np.float32)
            self.image_grid_thw = np.ascontiguousarray(self.image_grid_thw, dtype=np.int32)

    @property
    def generated(self) -> np.ndarray:
        """Boolean (R,): the response positions the model generated (``loss_mask == 1``)."""
        assert self.loss_mask is not None
        return self.loss_mask.astype(bool)

    def segments(self) -> list[tuple[str, int, int]]:
        """The response as ``(kind, start, end)`` runs, kind ``"model"`` or ``"env"``, in order."""
        runs: list[tuple[str, int, int]] = []
        for i, g in enumerate(self.generated.tolist()):
            kind = "model" if g else "env"
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], i + 1)
            else:
                runs.append((kind, i, i + 1))
        return runs

    @cached_property
    def min_version(self) -> int:
        """The oldest policy version that produced a token (staleness is measured from it).

        Computed once: the buffer's staleness screen and the learner's batch both ask for it."""
        versions = self.token_versions
        if len(versions) and value_range(self.loss_mask)[0] == 0:  # multi-turn: generated tokens only
            versions = versions[self.generated]
        return int(value_range(versions)[0]) if len(versions) else int(self.meta.get("version", 0))

    def staleness(self, learner_version: int) -> int:
        """``v - min(token_versions)`` at learner version ``v`` (docs/design.md §3.2)."""
        return learner_version - self.min_version


@dataclass(kw_only=True)
class Turns:
    """A response built turn by turn, aligned per token the way :class:`Trajectory` carries it: model turns
    with their log-probabilities and versions, environment turns with 0 and -1 (docs/environments.md §10.1)."""

    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)  # 0 on environment tokens
    versions: list[int] = field(default_factory=list)  # -1 on environment tokens
    mask: list[int] = field(default_factory=list)  # 1 generated, 0 environment

    def add(self, ids: list[int], logp: list[float], versions: list[int], generated: bool) -> None:
        """Append one turn; an environment turn's ``logp`` and ``versions`` are not read."""
        self.tokens += ids
        self.logp += logp if generated else [0.0] * len(ids)
        self.versions += versions if generated else [-1] * len(ids)
        self.mask += [int(generated)] * len(ids)

    def generated_versions(self) -> list[int]:
        """The policy versions of the generated tokens, in order."""
        return [v for v, m in zip(self.versions, self.mask, strict=True) if m]

    def as_trajectory(
        self,
        prompt_tokens: Sequence[int] | np.ndarray,
        *,
        prompt_id: str,
        group_id: str,
        reward: float,
        reward_parts: dict[str, float],
        finish_reason: str = "stop",
        server_id: str = "",
        meta: dict[str, Any],
        upto: int | None = None,
    ) -> Trajectory:
        """The prompt and this response (its first ``upto`` tokens; all by default) as a wire record under a
        fresh ``traj_id``."""
        n = len(self.tokens) if upto is None else upto
        return Trajectory(
            traj_id=uuid.uuid4().hex,
            group_id=group_id,
            prompt_id=prompt_id,
            prompt_tokens=prompt_tokens,
            response_tokens=self.tokens[:n],
            behav_logp=self.logp[:n],
            token_versions=self.versions[:n],
            loss_mask=self.mask[:n],
            reward=reward,
            reward_parts=reward_parts,
            finish_reason=finish_reason,
            server_id=server_id,
            meta=meta,
        )


@dataclass
class PromptRecord:
    """A prompt queued for the rollout servers: its text, token ids and the dataset record (for rewards).

    A record with ``images`` has their expanded placeholders in ``tokens``; the rollout server that takes
    it fills ``vision`` (tandem.vision.VisionInputs) from the images, which stays in that process: it is
    not encoded."""

    prompt_id: str
    text: str
    tokens: np.ndarray
    record: dict[str, Any] = field(default_factory=dict)
    vision: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)


# ------------------------------------------------------------------------------------------------ codec

SHORT = 256  # arrays up to this long are reduced through a Python list (see value_range)


def value_range(a: np.ndarray) -> tuple[Any, Any]:
    """``(min, max)`` of a non-empty integer array as Python numbers.

    A numpy reduction pays about 2 µs of call overhead, several times the work on a response of a few
    dozen tokens, and each trajectory's validation needs several: a short array goes through a list
    instead. Not for floats (NaN ordering): see :func:`_logprobs_valid`.
    """
    if len(a) <= SHORT:
        xs = a.tolist()
        return min(xs), max(xs)
    return a.min().item(), a.max().item()


def _logprobs_valid(a: np.ndarray) -> bool:
    """Every log-probability finite and <= 0 (a little float slack above); NaN fails every comparison."""
    if len(a) <= SHORT:
        return all(-math.inf < x <= 1e-4 for x in a.tolist())
    return bool(a.min() > -np.inf and a.max() <= 1e-4)


def routed_dtype(num_experts: int) -> np.dtype:
    """The integer dtype ``routed_experts`` travels in: one byte per index up to 256 experts."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int32)


def _pack_array(a: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(a)
    le = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    return [le.str, list(a.shape), a.astype(le, copy=False).tobytes()]


_ALLOWED_DTYPES = {"int32": "<i4", "float32": "<f4", "uint8": "|u1"}
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
    if not isinstance(raw, bytes) or len(raw) != shape[0] * _WIRE_DTYPES[dtype].itemsize:
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
    record = {
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
        "loss_mask": _pack_array(t.loss_mask),
    }
    if t.ref_logp is not None:  # optional: absent unless a server scored the reference
        record["ref_logp"] = _pack_array(t.ref_logp)
    if t.routed_experts is not None:  # optional: absent unless the engine recorded its routing
        record["routed_experts"] = _pack_array(t.routed_experts)
    if t.pixel_values is not None:  # optional: absent unless the prompt had images
        record["pixel_values"] = _pack_array(t.pixel_values)
        record["image_grid_thw"] = _pack_array(t.image_grid_thw)
    return _packb(record, "meta")


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
    if d.get("v") not in DECODABLE_VERSIONS or isinstance(d.get("v"), bool):
        raise SchemaError("v", f"schema version {d.get('v')!r}, expected one of {DECODABLE_VERSIONS}")
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
    if n and not _logprobs_valid(behav):
        raise SchemaError("behav_logp", "log-probabilities must be finite and <= 0")
    if d["v"] >= 2:
        loss_mask = _unpack_array("loss_mask", _get(d, "loss_mask", list), "uint8", max_tokens)
        if len(loss_mask) != n:
            raise SchemaError("loss_mask", f"length {len(loss_mask)} != len(response_tokens) {n}")
    else:
        loss_mask = np.ones(n, dtype=np.uint8)
    ref_logp = _decode_ref_logp(d, n, max_tokens)
    mask_lo, mask_hi = value_range(loss_mask) if n else (1, 1)
    if mask_hi > 1:
        raise SchemaError("loss_mask", "values must be 0 (environment token) or 1 (generated token)")
    if mask_lo == 1:  # every token generated (single-turn): one check instead of three
        if n and value_range(versions)[0] < 0:
            raise SchemaError("token_versions", "versions of generated tokens must be >= 0")
    else:
        generated = loss_mask.astype(bool)
        if generated.any() and versions[generated].min() < 0:
            raise SchemaError("token_versions", "versions of generated tokens must be >= 0")
        if not (versions[~generated] == -1).all():
            raise SchemaError("token_versions", "environment tokens (loss_mask 0) carry version -1")
        if (behav[~generated] != 0).any():
            raise SchemaError("behav_logp", "environment tokens (loss_mask 0) carry log-probability 0")
    prompt = _unpack_array("prompt_tokens", _get(d, "prompt_tokens", list), "int32", max_tokens)
    if len(prompt) == 0:
        raise SchemaError("prompt_tokens", "empty prompt (the first response token has nothing to follow)")
    routed = _decode_routed_experts(d, len(prompt) + n - 1, max_tokens)
    pixels, grid = _decode_images(d, max_tokens)
    for name, arr in (("prompt_tokens", prompt), ("response_tokens", resp)):
        if len(arr) and (lo := value_range(arr)[0]) < 0:
            raise SchemaError(name, f"negative token id {lo}")
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
    if not math.isfinite(reward):
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
        loss_mask=loss_mask,
        ref_logp=ref_logp,
        routed_experts=routed,
        pixel_values=pixels,
        image_grid_thw=grid,
    )


def _decode_ref_logp(d: dict[str, Any], n: int, max_tokens: int) -> np.ndarray | None:
    """The optional ``ref_logp``: None when absent; else one finite log-probability <= 0 per response token."""
    if "ref_logp" not in d:
        return None
    ref = _unpack_array("ref_logp", _get(d, "ref_logp", list), "float32", max_tokens)
    if len(ref) != n:
        raise SchemaError("ref_logp", f"length {len(ref)} != len(response_tokens) {n}")
    if n and not _logprobs_valid(ref):
        raise SchemaError("ref_logp", "log-probabilities must be finite and <= 0")
    return ref


def _decode_routed_experts(d: dict[str, Any], positions: int, max_tokens: int) -> np.ndarray | None:
    """The optional ``routed_experts``: None when absent; else (positions, layers, k) of uint8 or int32."""
    if "routed_experts" not in d:
        return None
    packed = _get(d, "routed_experts", list)
    if len(packed) != 3 or packed[0] not in ("|u1", "<i4"):
        raise SchemaError("routed_experts", "expected [dtype, shape, bytes] of uint8 or int32")
    dt, shape, raw = packed
    if not (
        isinstance(shape, (list, tuple))
        and len(shape) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape[1:])
    ):
        raise SchemaError("routed_experts", f"shape {shape!r}, expected (positions, layers, k)")
    if shape[0] != positions:
        raise SchemaError("routed_experts", f"{shape[0]} positions, expected P + R - 1 = {positions}")
    size = math.prod(shape)
    if size > max_tokens * 1024:  # 1024 (layer, k) slots per token is far above any model's
        raise SchemaError("routed_experts", f"{size} elements exceeds the limit of {max_tokens * 1024}")
    dtype = np.dtype(dt)
    if not isinstance(raw, bytes) or len(raw) != size * dtype.itemsize:
        raise SchemaError("routed_experts", f"byte length does not match shape {shape}")
    routed = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if dtype.kind == "i" and size and routed.min() < 0:
        raise SchemaError("routed_experts", "negative expert index")
    return routed


def _unpack_2d(name: str, packed: Any, wire: str, width: int | None, max_elements: int) -> np.ndarray:
    """A 2-D array of ``wire`` dtype (``width`` columns when given), at most ``max_elements``."""
    if not isinstance(packed, (list, tuple)) or len(packed) != 3 or packed[0] != wire:
        raise SchemaError(name, f"expected [dtype, shape, bytes] of {wire}")
    _, shape, raw = packed
    if not (
        isinstance(shape, (list, tuple))
        and len(shape) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)
        and (width is None or shape[1] == width)
    ):
        raise SchemaError(
            name,
            f"shape {shape!r}, expected two positive dimensions"
            + (f", the second {width}" if width is not None else ""),
        )
    size = math.prod(shape)
    if size > max_elements:
        raise SchemaError(name, f"{size} elements exceeds the limit of {max_elements}")
    dtype = np.dtype(wire)
    if not isinstance(raw, bytes) or len(raw) != size * dtype.itemsize:
        raise SchemaError(name, f"byte length does not match shape {shape}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _decode_images(d: dict[str, Any], max_tokens: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The optional ``pixel_values`` (patches, dim) and ``image_grid_thw`` (images, 3): both absent, or
    both present with each image's t·h·w patches adding up to the rows of ``pixel_values``. A cap in
    elements as for ``routed_experts`` (a hostile shape claim); ``run.max_traj_bytes`` bounds the entry."""
    if "pixel_values" not in d and "image_grid_thw" not in d:
        return None, None
    for name in ("pixel_values", "image_grid_thw"):
        if name not in d:
            raise SchemaError(name, "missing (pixel_values and image_grid_thw come together)")
    grid = _unpack_2d("image_grid_thw", d["image_grid_thw"], "<i4", 3, max_tokens)
    pixels = _unpack_2d("pixel_values", d["pixel_values"], "<f4", None, max_tokens * 1024)
    if grid.min() <= 0:
        raise SchemaError("image_grid_thw", "every image's (t, h, w) must be positive")
    if (patches := int(grid.astype(np.int64).prod(-1).sum())) != len(pixels):
        raise SchemaError("pixel_values", f"{len(pixels)} patches, the grid sizes say {patches}")
    if not np.isfinite(pixels).all():
        raise SchemaError("pixel_values", "values must be finite")
    return pixels, grid


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
