"""Supervised fine-tuning of a vision-language model on demonstrations with images (learner/sft.py,
learner/examples.py): the tiny Qwen2-VL saved by path, real images, the recipe's own trainer.

The loss the trainer computes is the one a plain forward with the row's pixels gives (and not the one
without them, or with another image); a bad image record fails the load naming its line and field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from learner.examples import ExampleError, load_demonstrations
from learner.sft import SFTTrainer
from tandem.config import load_config
from tandem.vision import SUPPRESSED_LOGIT, VisionProcessor, mm_token_type_ids, placeholder_ids
from toy.tasks import colour, demonstration_records
from toy.tiny import make_tiny

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-vl"), arch="qwen2-vl")["actor"]


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_config(actor: Path, train: Path) -> dict:
    return {
        "run": {"name": "vl-sft", "device": "cpu", "seed": 0},
        "model": {"actor": str(actor)},
        "data": {"prompts": str(REPO / "pyproject.toml")},  # required by the schema, unused offline
        "algorithm": {"recipe": "sft", "train_file": str(train), "batch_size": 4, "chat_template": True},
        "learner": {"micro_batch_size": 2, "checkpoint_interval": 0},
        "logging": {"wandb_mode": "disabled"},
    }


def plain_nll(model, processor: VisionProcessor, record: dict, image_of: dict) -> tuple[float, int]:
    """The summed NLL of the record's response and EOS, and their count, from one forward of the model
    with ``image_of``'s image: what the trainer's loss must be made of."""
    ids, vision = processor.encode(record["prompt"], [colour.draw(image_of)])
    response = processor.tokenizer(record["response"])["input_ids"] + [processor.tokenizer.eos_token_id]
    x = torch.tensor([ids + response])
    with torch.no_grad():
        logits = model(
            input_ids=x,
            pixel_values=vision.pixel_values,
            image_grid_thw=vision.image_grid_thw,
            mm_token_type_ids=mm_token_type_ids(x, processor.image_token_id),
        ).logits[0, len(ids) - 1 : -1]
    logits[:, placeholder_ids(model.config)] = SUPPRESSED_LOGIT  # never written, as the engine samples
    logp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(response)[:, None])
    return float(-logp.sum()), len(response)


def test_the_sft_loss_reads_each_rows_image(vl: Path, tmp_path: Path) -> None:
    rng = random.Random(3)
    sources = [colour.make_record(rng, i) for i in range(4)]
    demos = [colour.demonstration_record(r) for r in sources]
    train = write(tmp_path / "demos.jsonl", demos)
    trainer = SFTTrainer(load_config(None, raw=sft_config(vl, train)), tmp_path / "run")
    trainer.load_models()
    examples = trainer.load_examples(str(train))
    model = AutoModelForImageTextToText.from_pretrained(vl).eval()
    processor = VisionProcessor.from_pretrained(vl)
    want = [plain_nll(model, processor, d, s) for d, s in zip(demos, sources, strict=True)]
    for example, (nll, n), source, demo in zip(examples, want, sources, demos, strict=True):
        got = trainer.evaluate([example])["eval/loss"]
        assert got == pytest.approx(nll / n, rel=1e-5)
        other = next(s for s in sources if s["answer"] != source["answer"])
        assert abs(got - plain_nll(model, processor, demo, other)[0] / n) > 1e-6  # the image matters
    # The batch (two micro-batches, rows sorted by length): each row still reads its own image.
    total = sum(nll for nll, _ in want) / sum(n for _, n in want)
    assert trainer.evaluate(examples)["eval/loss"] == pytest.approx(total, rel=1e-5)


def test_an_sft_step_on_images_lowers_the_loss(vl: Path, tmp_path: Path) -> None:
    train = write(tmp_path / "demos.jsonl", demonstration_records("colour", 8, seed=1))
    raw = sft_config(vl, train)
    raw["learner"]["actor_lr"] = 3e-3
    trainer = SFTTrainer(load_config(None, raw=raw), tmp_path / "run")
    trainer.load_models()
    examples = trainer.load_examples(str(train))
    before = trainer.evaluate(examples)["eval/loss"]
    for _ in range(3):
        trainer.train_step(examples)
    assert trainer.evaluate(examples)["eval/loss"] < before


@pytest.mark.parametrize(
    "images, reason",
    [
        (["https://example.com/a.png"], "remote image URLs are refused"),
        (["missing.png"], "no such file"),
        (["data:image/png;base64,AAAA"], "not a readable image"),
        ([], "non-empty list"),
    ],
)
def test_a_bad_image_record_names_its_line_and_field(
    vl: Path, tmp_path: Path, images: list, reason: str
) -> None:
    good = demonstration_records("colour", 1)[0]
    path = write(tmp_path / "demos.jsonl", [good, {**good, "images": images}])
    processor = VisionProcessor.from_pretrained(vl)
    with pytest.raises(ExampleError) as e:
        load_demonstrations(path, processor.tokenizer, max_tokens=128, vision=processor, chat_template=True)
    assert str(e.value).startswith(f"{path}:2: field 'images'") and reason in str(e.value), str(e.value)


def test_images_for_a_text_model_are_refused(tiny_ckpt: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write(tmp_path / "demos.jsonl", demonstration_records("colour", 1))
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    with pytest.raises(ExampleError, match=r"demos.jsonl:1: field 'images': the model is not a vision"):
        load_demonstrations(path, tokenizer, max_tokens=128)
