"""A trajectory's images on the wire: ``pixel_values`` and ``image_grid_thw`` round-trip through the codec,
are absent for a text prompt, and a malformed or oversized pair is refused naming the field."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from buffer.schema import SchemaError, Trajectory, decode_trajectory, encode_trajectory

PATCH_DIM = 1176  # 3 channels x 2 frames x 14 x 14, Qwen2-VL's


def traj(**images: np.ndarray) -> Trajectory:
    return Trajectory("t", "g", "p", np.arange(1, 9), np.array([3, 4]), [-0.5, -1.0], [0, 0], 1.0, **images)


def images(grids: list[list[int]]) -> dict[str, np.ndarray]:
    grid = np.array(grids, dtype=np.int32)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((int(grid.prod(-1).sum()), PATCH_DIM)).astype(np.float32)
    return {"pixel_values": pixels, "image_grid_thw": grid}


def test_images_round_trip_exactly() -> None:
    sent = images([[1, 4, 4], [1, 2, 6]])
    got = decode_trajectory(encode_trajectory(traj(**sent)))
    assert got.pixel_values is not None and got.image_grid_thw is not None
    np.testing.assert_array_equal(got.pixel_values, sent["pixel_values"])
    np.testing.assert_array_equal(got.image_grid_thw, sent["image_grid_thw"])
    assert got.pixel_values.dtype == np.float32 and got.image_grid_thw.dtype == np.int32


def test_a_text_trajectory_carries_no_image_keys() -> None:
    data = encode_trajectory(traj())
    assert not {"pixel_values", "image_grid_thw"} & set(msgpack.unpackb(data))
    got = decode_trajectory(data)
    assert got.pixel_values is None and got.image_grid_thw is None


def test_the_pixels_count_against_the_entry_size() -> None:
    sent = images([[1, 4, 4]])
    # run.max_traj_bytes is checked on the encoded entry, which holds every pixel byte
    assert (
        len(encode_trajectory(traj(**sent))) - len(encode_trajectory(traj())) >= sent["pixel_values"].nbytes
    )


def tampered(**changes: object) -> bytes:
    d = msgpack.unpackb(encode_trajectory(traj(**images([[1, 4, 4]]))))
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return msgpack.packb(d, use_bin_type=True)


def packed(a: np.ndarray) -> list[object]:
    return [a.dtype.str, list(a.shape), a.tobytes()]


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"image_grid_thw": None}, "image_grid_thw", "come together"),
        ({"pixel_values": None}, "pixel_values", "come together"),
        ({"image_grid_thw": packed(np.array([[1, 4, 5]], np.int32))}, "pixel_values", "grid sizes say 20"),
        ({"image_grid_thw": packed(np.array([[1, 4, 4, 1]], np.int32))}, "image_grid_thw", "the second 3"),
        ({"image_grid_thw": packed(np.array([[1, 0, 4]], np.int32))}, "image_grid_thw", "positive"),
        ({"image_grid_thw": packed(np.array([[1, 4, 4]], np.int64))}, "image_grid_thw", "<i4"),
        ({"pixel_values": packed(np.zeros((16, 4), np.float64))}, "pixel_values", "<f4"),
        ({"pixel_values": packed(np.full((16, 4), np.nan, np.float32))}, "pixel_values", "finite"),
        ({"pixel_values": ["<f4", [16, 4], b"\0" * 12]}, "pixel_values", "byte length"),
    ],
)
def test_a_malformed_pair_is_refused_naming_the_field(changes: dict, field: str, says: str) -> None:
    with pytest.raises(SchemaError) as e:
        decode_trajectory(tampered(**changes))
    assert e.value.field == field and says in str(e.value)


def test_the_element_limit_applies() -> None:
    data = encode_trajectory(traj(**images([[1, 4, 4]])))  # 16 x 1176 = 18,816 pixel values
    with pytest.raises(SchemaError, match="pixel_values: 18816 elements exceeds the limit of 10240"):
        decode_trajectory(data, max_tokens=10)
    assert decode_trajectory(data, max_tokens=20).pixel_values is not None


def test_a_trajectory_needs_both_fields() -> None:
    with pytest.raises(ValueError, match="come together"):
        traj(pixel_values=np.zeros((16, PATCH_DIM), np.float32))


def test_pixel_bytes_counts_every_samples_copy() -> None:
    """A 56x56 image is 16 patches: 16 x 1176 float32 and a (1, 3) int32 grid, 75,276 bytes; a group of four
    samples of it carries four copies, and a text sample none."""
    from tandem.vision import pixel_bytes

    one = images([[1, 4, 4]])
    assert pixel_bytes([traj(**one)]) == 16 * PATCH_DIM * 4 + 3 * 4 == 75_276
    assert pixel_bytes([traj(**one)] * 4 + [traj()]) == 4 * 75_276
