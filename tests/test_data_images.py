"""Prompt records with images: checked up front like every other field, named by file, line and entry, or
set aside under ``data.on_bad_record: skip``; remote URLs refused."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image

from tandem.data import DatasetError, Rejected, prompt_records
from tandem.vision import load_image


def png_bytes(colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def write(tmp_path: Path, *records: dict) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


@pytest.fixture
def images_dir(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png_bytes())
    (tmp_path / "img" / "broken.png").write_bytes(png_bytes()[:40])  # cut inside the image data
    return tmp_path


def test_paths_relative_to_the_file_and_data_urls_load(images_dir: Path) -> None:
    p = write(
        images_dir,
        {"prompt": "colour?", "images": ["img/red.png"]},
        {"prompt": "colour?", "images": [data_url(png_bytes((0, 0, 255)))]},
    )
    records = prompt_records(p)
    assert records[0][1]["images"] == ["img/red.png"]
    assert load_image("img/red.png", images_dir).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(records[1][1]["images"][0], images_dir).getpixel((0, 0)) == (0, 0, 255)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("img/missing.png", "no such file"),
        ("img/broken.png", "not a readable image"),
        ("data:image/png;base64,!!!", "does not decode"),
        (data_url(b"not an image at all"), "not a readable image"),
        ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
        ("https://example.com/cat.png", "nothing is downloaded"),
        ("", "non-empty string"),
    ],
)
def test_a_bad_image_is_an_error_naming_file_line_and_entry(images_dir: Path, entry: str, says: str) -> None:
    p = write(
        images_dir,
        {"prompt": "ok", "images": ["img/red.png"]},
        {"prompt": "colour?", "images": ["img/red.png", entry]},
    )
    with pytest.raises(DatasetError) as e:
        prompt_records(p)
    assert f"{p}:2: field 'images' entry 1:" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("value", ["img/red.png", [], [3]])
def test_images_must_be_a_list_of_entries(images_dir: Path, value: object) -> None:
    p = write(images_dir, {"prompt": "colour?", "images": value})
    with pytest.raises(DatasetError, match=f"{p}:1: field 'images'"):
        prompt_records(p)


def test_bad_image_records_are_set_aside_under_skip(images_dir: Path) -> None:
    p = write(
        images_dir,
        {"prompt": "a", "images": ["img/red.png"]},
        {"prompt": "b", "images": ["img/missing.png"]},
        {"prompt": "c", "images": ["http://example.com/x.png"]},
        {"prompt": "d"},
    )
    rejected: list[Rejected] = []
    records = prompt_records(p, rejected=rejected)
    assert [r["prompt"] for _, r in records] == ["a", "d"]
    assert [r.line for r in rejected] == [2, 3]
    assert "img/missing.png" in rejected[0].reason and "nothing is downloaded" in rejected[1].reason
    assert json.loads(rejected[0].raw)["prompt"] == "b"  # the line as it was, for rejected_prompts.jsonl


def test_the_colour_task_writes_images_its_records_name(tmp_path: Path) -> None:
    from toy.tasks import colour, write_prompt_file

    p = write_prompt_file("colour", tmp_path / "data" / "colour.jsonl", 12, seed=1)
    records = [r for _, r in prompt_records(p)]  # every image checked, as a run's start does
    assert {r["answer"] for r in records} == set(colour.COLOURS)
    for r in records:
        x, y, size = r["square"]
        img = load_image(r["images"][0], p.parent)
        assert img.size == (colour.SIDE, colour.SIDE)
        assert img.getpixel((x + size // 2, y + size // 2)) == colour.COLOURS[r["answer"]]
        assert img.getpixel((0, 0) if x or y else (colour.SIDE - 1, colour.SIDE - 1)) == (255, 255, 255)
    r = records[0]
    assert colour.reward(r["prompt"], f" {r['answer'].title()}.", r) == 1.0
    assert colour.reward(r["prompt"], colour.near_miss(random.Random(0), r), r) == 0.0
    assert colour.reward(r["prompt"], r["answer"] + " square", r) == 0.0
