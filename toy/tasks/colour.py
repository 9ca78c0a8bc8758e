"""``colour``: name the colour of the square in the image. The visual toy task, drawn with PIL.

Each prompt carries one 56x56 image (:data:`toy.tiny.VL_IMAGE_SIDE`, four image tokens for the tiny
Qwen2-VL): a red, green or blue square of random size and place on white. The prompt text is the same for
every record, so only the image says the answer. The reward is 1 for the exact colour word (case and
surrounding spaces or a final full stop aside), else 0: a random policy almost never writes it.

``python -m toy make-data colour OUT.jsonl --n N`` writes the PNGs into ``OUT-images/`` beside the prompt
file, and each record names its image by a path relative to the file (tandem/data.py reads it so).
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from tandem.data import write_prompts

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 30), "blue": (30, 60, 220)}
SIDE = 56  # toy.tiny.VL_IMAGE_SIDE (not imported: that module loads transformers)
PROMPT = "what colour is the square?"


def make_record(rng: random.Random, i: int, folder: str = "colour-images") -> dict[str, Any]:
    colour = rng.choice(sorted(COLOURS))
    size = rng.randint(16, 40)
    x, y = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
    return {
        "id": f"colour-{i}",
        "prompt": PROMPT,
        "answer": colour,
        "images": [f"{folder}/{i:06d}.png"],
        "square": [x, y, size],
    }


def draw(record: dict[str, Any]) -> Image.Image:
    """The record's image: its square on white."""
    x, y, size = record["square"]
    img = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    ImageDraw.Draw(img).rectangle([x, y, x + size - 1, y + size - 1], fill=COLOURS[record["answer"]])
    return img


def data_url(record: dict[str, Any]) -> str:
    """The record's image as a ``data:image/png;base64,`` URL."""
    png = io.BytesIO()
    draw(record).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def write(path: str | Path, n: int, seed: int = 0, *, inline: bool = False) -> Path:
    """``n`` records to ``path`` and their PNGs to ``<stem>-images/`` beside it, or with ``inline`` each
    PNG inside its record as a ``data:image/png;base64,`` URL (one file: what a prepare step can make,
    since it renames the one path it produces)."""
    p = Path(path)
    folder = f"{p.stem}-images"
    rng = random.Random(seed)
    records = [make_record(rng, i, folder) for i in range(n)]
    if inline:
        for r in records:
            r["images"] = [data_url(r)]
        return write_prompts(p, records)
    (p.parent / folder).mkdir(parents=True, exist_ok=True)
    for r in records:
        draw(r).save(p.parent / r["images"][0])
    return write_prompts(p, records)


def reward(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """1 for the record's colour word, else 0 (0 when malformed)."""
    answer = record.get("answer") if isinstance(record, dict) else None
    if not isinstance(answer, str) or not isinstance(completion, str):
        return 0.0
    return float(completion.strip().removesuffix(".").strip().lower() == answer)


CHAT_TEMPLATE = True  # prompts go through the model's chat template, which puts the image before the text


def demonstration_record(record: dict[str, Any]) -> dict[str, Any]:
    """A warm start's record: the prompt with its image, and a colour drawn independently of the image
    (seeded by the record's id). The model learns to answer with a colour word while image features are
    in its input, about a third right; only reinforcement can teach it which colour the image shows."""
    rng = random.Random(record["id"])
    return {"prompt": PROMPT, "images": [data_url(record)], "response": rng.choice(sorted(COLOURS))}


def near_miss(rng: random.Random, record: dict[str, Any]) -> str:
    """Another colour."""
    return rng.choice([c for c in sorted(COLOURS) if c != record["answer"]])
