"""Wire records: every field survives a round trip, and each kind of corruption is refused naming its field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from buffer.schema import (
    SHORT,
    PromptRecord,
    SchemaError,
    Trajectory,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
    value_range,
)


def full_traj() -> Trajectory:
    return Trajectory(
        traj_id="t-1",
        group_id="g-7",
        prompt_id="p-3",
        prompt_tokens=np.array([5, 6, 7, 2**31 - 1], dtype=np.int32),
        response_tokens=np.array([9, 0, 2**31 - 1], dtype=np.int32),
        behav_logp=np.array([-0.5, -1e-9, -20.25], dtype=np.float32),
        token_versions=np.array([3, 3, 4], dtype=np.int32),
        reward=0.75,
        reward_parts={"format": 0.25, "answer": 0.5},
        finish_reason="length",
        server_id="server-1",
        created_at=1234.5,
        meta={"engine": "hf", "nested": {"k": [1, 2.5, "x"]}, "text": "héllo ✓"},
    )


def test_trajectory_round_trip_keeps_every_field():
    t = full_traj()
    back = decode_trajectory(encode_trajectory(t))
    for name in ("traj_id", "group_id", "prompt_id", "reward", "reward_parts", "finish_reason"):
        assert getattr(back, name) == getattr(t, name), name
    assert (back.server_id, back.created_at, back.meta) == (t.server_id, t.created_at, t.meta)
    for name, dtype in [
        ("prompt_tokens", np.int32),
        ("response_tokens", np.int32),
        ("behav_logp", np.float32),
        ("token_versions", np.int32),
    ]:
        arr = getattr(back, name)
        assert arr.dtype == dtype and arr.shape == getattr(t, name).shape, name
        np.testing.assert_array_equal(arr, getattr(t, name))
    assert back.response_tokens.flags.writeable  # a copy, not a view into the message
    assert back.staleness(6) == 3


def test_arrays_travel_as_raw_bytes_not_lists():
    d = msgpack.unpackb(encode_trajectory(full_traj()))
    assert d["behav_logp"][0] == "<f4" and d["behav_logp"][1] == [3]
    assert isinstance(d["behav_logp"][2], bytes) and len(d["behav_logp"][2]) == 12


def test_big_endian_and_wider_inputs_are_normalised():
    t = full_traj()
    t.behav_logp = np.array([-0.5, -1.0, -2.0], dtype=">f8")
    t.response_tokens = np.array([1, 2, 3], dtype=">i8")
    t.__post_init__()
    back = decode_trajectory(encode_trajectory(t))
    np.testing.assert_array_equal(back.behav_logp, [-0.5, -1.0, -2.0])
    np.testing.assert_array_equal(back.response_tokens, [1, 2, 3])


@pytest.mark.parametrize("finish", ["stop", "length", "abort"])
def test_empty_response_and_every_finish_reason(finish: str):
    t = Trajectory("t", "g", "p", [1], [], [], [], reward=0, finish_reason=finish, meta={"version": 4})
    back = decode_trajectory(encode_trajectory(t))
    assert back.finish_reason == finish and len(back.response_tokens) == 0
    assert back.min_version == 4  # no tokens: the version is taken from meta


def test_prompt_round_trip():
    p = PromptRecord("p-1", "What is 2+2? ✓", [1, 2, 3], {"answer": "4", "tags": ["math"]})
    back = decode_prompt(encode_prompt(p))
    assert (back.prompt_id, back.text, back.record) == (p.prompt_id, p.text, p.record)
    assert back.tokens.dtype == np.int32
    np.testing.assert_array_equal(back.tokens, [1, 2, 3])


# --------------------------------------------------------------------------------------------- failures


def mutated(fn: Callable[[dict[str, Any]], None]) -> bytes:
    """A valid encoded trajectory with fn applied to its decoded map."""
    d = msgpack.unpackb(encode_trajectory(full_traj()))
    fn(d)
    return msgpack.packb(d, use_bin_type=True)


def arr(dtype: str, values: list[float]) -> list[Any]:
    a = np.array(values, dtype=dtype)
    return [a.dtype.str, list(a.shape), a.tobytes()]


CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("schema version", lambda d: d.update(v=3), "v"),
    ("missing id", lambda d: d.pop("traj_id"), "traj_id"),
    ("id not a string", lambda d: d.update(traj_id=17), "traj_id"),
    ("reward is bool", lambda d: d.update(reward=True), "reward"),
    ("reward is NaN", lambda d: d.update(reward=float("nan")), "reward"),
    ("reward is text", lambda d: d.update(reward="1"), "reward"),
    ("response as float", lambda d: d.update(response_tokens=arr("<f4", [1, 2, 3])), "response_tokens"),
    ("logp as float64", lambda d: d.update(behav_logp=arr("<f8", [-1, -1, -1])), "behav_logp"),
    ("versions as int64", lambda d: d.update(token_versions=arr("<i8", [1, 1, 1])), "token_versions"),
    ("big-endian dtype", lambda d: d.update(prompt_tokens=arr(">i4", [1])), "prompt_tokens"),
    ("2-D shape", lambda d: d["prompt_tokens"].__setitem__(1, [2, 2]), "prompt_tokens"),
    ("negative shape", lambda d: d["prompt_tokens"].__setitem__(1, [-1]), "prompt_tokens"),
    ("bytes short of shape", lambda d: d["behav_logp"].__setitem__(2, b"\0" * 8), "behav_logp"),
    ("array not a triple", lambda d: d.update(prompt_tokens=[1, 2, 3, 4]), "prompt_tokens"),
    ("array as list", lambda d: d.update(prompt_tokens=[["<i4", [1], [5]]]), "prompt_tokens"),
    ("short logp", lambda d: d.update(behav_logp=arr("<f4", [-1, -1])), "behav_logp"),
    ("long versions", lambda d: d.update(token_versions=arr("<i4", [1, 1, 1, 1])), "token_versions"),
    ("positive logp", lambda d: d.update(behav_logp=arr("<f4", [-1, 0.5, -1])), "behav_logp"),
    ("NaN logp", lambda d: d.update(behav_logp=arr("<f4", [-1, np.nan, -1])), "behav_logp"),
    ("negative version", lambda d: d.update(token_versions=arr("<i4", [1, -1, 1])), "token_versions"),
    ("negative token", lambda d: d.update(response_tokens=arr("<i4", [1, -2, 1])), "response_tokens"),
    ("empty prompt", lambda d: d.update(prompt_tokens=arr("<i4", [])), "prompt_tokens"),
    ("unknown finish", lambda d: d.update(finish_reason="eos"), "finish_reason"),
    ("reward part text", lambda d: d.update(reward_parts={"a": "x"}), "reward_parts"),
    ("reward part inf", lambda d: d.update(reward_parts={"a": float("inf")}), "reward_parts"),
    ("meta not a map", lambda d: d.update(meta=[1]), "meta"),
    ("created_at text", lambda d: d.update(created_at="now"), "created_at"),
    ("missing loss_mask (v2)", lambda d: d.pop("loss_mask"), "loss_mask"),
    ("short loss_mask", lambda d: d.update(loss_mask=arr("|u1", [1, 1])), "loss_mask"),
    ("loss_mask of 2", lambda d: d.update(loss_mask=arr("|u1", [1, 2, 1])), "loss_mask"),
    ("loss_mask as int32", lambda d: d.update(loss_mask=arr("<i4", [1, 1, 1])), "loss_mask"),
    ("env token with a version", lambda d: d.update(loss_mask=arr("|u1", [1, 0, 1])), "token_versions"),
]


@pytest.mark.parametrize(("what", "fn", "field"), CASES, ids=[c[0] for c in CASES])
def test_decode_refuses_naming_the_field(what: str, fn: Callable[[dict[str, Any]], None], field: str):
    with pytest.raises(SchemaError) as e:
        decode_trajectory(mutated(fn))
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(f"{field}: ")


def long_traj(n: int) -> dict[str, Any]:
    """A valid trajectory's map with an ``n``-token response."""
    d = msgpack.unpackb(encode_trajectory(full_traj()))
    d.update(
        response_tokens=arr("<i4", [7] * n),
        behav_logp=arr("<f4", [-1.0] * n),
        token_versions=arr("<i4", [3] * n),
        loss_mask=arr("|u1", [1] * n),
    )
    return d


BAD_AT_THE_END: list[tuple[str, str, str, float]] = [
    ("NaN logp", "behav_logp", "<f4", np.nan),
    ("-inf logp", "behav_logp", "<f4", -np.inf),
    ("positive logp", "behav_logp", "<f4", 0.5),
    ("negative token", "response_tokens", "<i4", -2),
    ("negative version", "token_versions", "<i4", -1),
    ("loss_mask of 2", "loss_mask", "|u1", 2),
]


@pytest.mark.parametrize("n", [SHORT - 1, SHORT + 1], ids=["list path", "numpy path"])
@pytest.mark.parametrize(
    ("what", "field", "dtype", "bad"), BAD_AT_THE_END, ids=[c[0] for c in BAD_AT_THE_END]
)
def test_short_and_long_arrays_are_checked_alike(n: int, what: str, field: str, dtype: str, bad: float):
    """Short arrays are reduced in Python, long ones in numpy (value_range): both refuse the same values,
    wherever they sit (NaN last, where a Python min/max would skip it)."""
    good = long_traj(n)
    assert len(decode_trajectory(msgpack.packb(good, use_bin_type=True)).response_tokens) == n
    for where in (0, n - 1):
        d = long_traj(n)
        values = np.frombuffer(d[field][2], dtype=dtype).copy()
        values[where] = bad
        d[field] = arr(dtype, values.tolist())
        with pytest.raises(SchemaError) as e:
            decode_trajectory(msgpack.packb(d, use_bin_type=True))
        assert e.value.field == field, str(e.value)


def test_value_range_matches_numpy_on_both_paths():
    rng = np.random.default_rng(0)
    for n in (1, 2, SHORT, SHORT + 1, 4 * SHORT):
        a = rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int32)
        assert value_range(a) == (int(a.min()), int(a.max()))
        assert all(type(x) is int for x in value_range(a))


@pytest.mark.parametrize(
    "data",
    [b"\xc1garbage", b"", msgpack.packb([1, 2]), "a str", msgpack.packb({"v": 1}) + b"x"],
    ids=["garbage", "empty", "not a map", "not bytes", "trailing bytes"],
)
def test_garbage_is_a_schema_error_not_a_crash(data: Any):
    with pytest.raises(SchemaError) as e:
        decode_trajectory(data)
    assert e.value.field == "trajectory"


def test_oversize_arrays_are_refused_before_allocation():
    t = full_traj()
    t.prompt_tokens = np.zeros(100, dtype=np.int32)
    with pytest.raises(SchemaError, match="100 elements exceeds the limit of 64") as e:
        decode_trajectory(encode_trajectory(t), max_tokens=64)
    assert e.value.field == "prompt_tokens"


def test_unencodable_meta_names_the_field():
    t = full_traj()
    t.meta = {"bad": object()}
    with pytest.raises(SchemaError) as e:
        encode_trajectory(t)
    assert e.value.field == "meta"
    with pytest.raises(SchemaError) as e:
        encode_prompt(PromptRecord("p", "x", [1], {"bad": {1, 2}}))
    assert e.value.field == "record"


@pytest.mark.parametrize(
    ("fn", "field"),
    [
        (lambda d: d.update(tokens=arr("<i4", [])), "tokens"),
        (lambda d: d.update(tokens=arr("<f4", [1.0])), "tokens"),
        (lambda d: d.pop("text"), "text"),
        (lambda d: d.update(record="x"), "record"),
        (lambda d: d.update(v=0), "v"),
    ],
    ids=["empty", "float tokens", "no text", "record not a map", "version"],
)
def test_prompt_decode_refuses_naming_the_field(fn: Callable[[dict[str, Any]], None], field: str):
    d = msgpack.unpackb(encode_prompt(PromptRecord("p", "x", [1, 2])))
    fn(d)
    with pytest.raises(SchemaError) as e:
        decode_prompt(msgpack.packb(d, use_bin_type=True))
    assert e.value.field == field


def multi_turn_traj() -> Trajectory:
    """prompt | model turn (2) | env turn (3) | model turn (1)."""
    return Trajectory(
        traj_id="t-2",
        group_id="g",
        prompt_id="p",
        prompt_tokens=[5, 6],
        response_tokens=[7, 8, 20, 21, 22, 9],
        behav_logp=[-0.5, -0.25, 0.0, 0.0, 0.0, -1.5],
        token_versions=[4, 4, -1, -1, -1, 5],
        loss_mask=[1, 1, 0, 0, 0, 1],
        reward=1.0,
        meta={"turn_rewards": [0.0, 1.0]},
    )


def test_multi_turn_round_trip_keeps_the_mask_and_segments():
    t = multi_turn_traj()
    back = decode_trajectory(encode_trajectory(t))
    assert back.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(back.loss_mask, [1, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(back.token_versions, t.token_versions)
    assert back.segments() == [("model", 0, 2), ("env", 2, 5), ("model", 5, 6)]
    # Staleness is measured from generated tokens only: the env tokens' -1 is not a version.
    assert back.min_version == 4 and back.staleness(6) == 2


def test_version_1_entries_still_decode_as_single_turn():
    d = msgpack.unpackb(encode_trajectory(full_traj()))
    d.pop("loss_mask")
    d["v"] = 1
    back = decode_trajectory(msgpack.packb(d, use_bin_type=True))
    np.testing.assert_array_equal(back.loss_mask, [1, 1, 1])
    assert back.segments() == [("model", 0, 3)]
    # and a v1 entry may not carry the negative versions only environment tokens have
    d["token_versions"] = arr("<i4", [1, -1, 1])
    with pytest.raises(SchemaError) as e:
        decode_trajectory(msgpack.packb(d, use_bin_type=True))
    assert e.value.field == "token_versions"


def test_env_token_with_a_logprob_is_refused():
    d = msgpack.unpackb(encode_trajectory(multi_turn_traj()))
    d["behav_logp"] = arr("<f4", [-0.5, -0.25, -0.1, 0.0, 0.0, -1.5])
    with pytest.raises(SchemaError) as e:
        decode_trajectory(msgpack.packb(d, use_bin_type=True))
    assert e.value.field == "behav_logp"
