"""Vision-language prompts: the tiny Qwen2-VL checkpoint, the hf engine generating from images, and the
learner's forward recomputing the engine's logprobs from the same processor outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from buffer.schema import Trajectory, decode_trajectory, encode_trajectory
from learner.batch import make_batch, micro_batches, response_view, with_vision
from learner.models import output_head, policy_logits, policy_logprobs
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from tandem.logprobs import logprobs_from_logits
from tandem.vision import VisionInputs, VisionProcessor
from toy.tiny import IMAGE_PAD, VL_IMAGE_SIDE, make_tiny

RED, BLUE = (255, 0, 0), (0, 0, 255)


def square(colour: tuple[int, int, int]) -> Image.Image:
    img = Image.new("RGB", (VL_IMAGE_SIDE, VL_IMAGE_SIDE), (255, 255, 255))
    img.paste(colour, (14, 14, 42, 42))
    return img


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-vl"), arch="qwen2-vl")["actor"]


@pytest.fixture(scope="module")
def engine(vl: Path) -> HFEngine:
    return HFEngine(str(vl), device="cpu", seed=0)


def test_tiny_vl_checkpoint_reloads_by_path(vl: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(vl)
    params = sum(p.numel() for p in model.parameters())
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and params < 500_000
    text = model.config.get_text_config()
    assert text.hidden_size // text.num_attention_heads >= 32  # vLLM's CPU attention
    tok = AutoTokenizer.from_pretrained(vl)
    assert tok.convert_tokens_to_ids(IMAGE_PAD) == model.config.image_token_id
    assert AutoImageProcessor.from_pretrained(vl).merge_size == 2
    ids, vision = VisionProcessor.from_pretrained(vl).encode("what colour?", [square(RED)])
    assert vision.image_grid_thw.tolist() == [[1, 4, 4]]  # 56x56: 4x4 patches of 14
    assert ids.count(model.config.image_token_id) == 4  # merged 2x2


def generate(engine: HFEngine, colours: list[tuple[int, int, int]], texts: list[str], n: int = 2):
    assert engine.vision is not None
    encoded = [engine.vision.encode(t, [square(c)]) for t, c in zip(texts, colours, strict=True)]
    prompts = [ids for ids, _ in encoded]
    images = [v for _, v in encoded]
    sampling = SamplingParams(n=n, max_new_tokens=8, temperature=1.0, seed=3)
    return prompts, images, engine.generate(prompts, sampling, images=images)


def learner_logprobs(
    engine: HFEngine, prompts: list[list[int]], images: list[VisionInputs], out, chunked: bool
) -> list[np.ndarray]:
    """The sampled tokens' logprobs through the learner's batch and forward (pad layout), per row. Each
    row's images travel as the trajectory's wire fields, through the codec."""
    trajs = []
    for i, (p, completions) in enumerate(zip(prompts, out, strict=True)):
        for j, c in enumerate(completions):
            t = Trajectory(
                f"t{i}-{j}",
                f"g{i}",
                f"p{i}",
                np.array(p),
                np.array(c.token_ids),
                np.array(c.logprobs),
                np.array(c.versions),
                0.0,
                finish_reason=c.finish_reason,
                **images[i].arrays(),
            )
            trajs.append(decode_trajectory(encode_trajectory(t)))
    row_images = [VisionInputs.of(t) for t in trajs]
    batch = make_batch(trajs, version=0)
    model = engine.model
    assert engine.vision is not None
    got = [np.zeros(0)] * len(trajs)
    for mb in micro_batches(batch, torch.arange(len(trajs)), 8, "pad", torch.device("cpu")):
        mb = with_vision(mb, [row_images[r] for r in mb.rows.tolist()], engine.model.config)
        mask = batch.mask[mb.rows]
        with torch.no_grad():
            if chunked:
                head = output_head(model)
                assert head is not None
                logp, _ = policy_logprobs(
                    model, mb, 1.0, mask, head, chunk_logits=1 << 16, with_entropy=False
                )
            else:
                logp = logprobs_from_logits(response_view(policy_logits(model, mb, 1.0), mb), mb.targets)
        for k, r in enumerate(mb.rows.tolist()):
            got[r] = logp[k, : len(trajs[r].response_tokens)].numpy()
    return got


@pytest.mark.parametrize("chunked", [False, True], ids=["logits", "chunked-head"])
def test_learner_recomputes_the_engines_logprobs_from_the_same_images(
    engine: HFEngine, chunked: bool
) -> None:
    # Two prompts of different lengths: the engine left-pads them, the learner right-pads.
    prompts, images, out = generate(engine, [RED, BLUE], ["what colour is it?", "colour?"])
    assert all(p.count(engine.vision.image_token_id) == 4 for p in prompts if engine.vision is not None)
    got = learner_logprobs(engine, prompts, images, out, chunked)
    behav = [np.array(c.logprobs) for completions in out for c in completions]
    for g, b in zip(got, behav, strict=True):
        assert len(b) >= 1
        np.testing.assert_allclose(g, b, atol=1e-4)


def test_a_different_image_gives_different_logprobs(engine: HFEngine) -> None:
    prompts, images, out = generate(engine, [RED], ["what colour is it?"], n=1)
    same = learner_logprobs(engine, prompts, images, out, chunked=False)[0]
    assert engine.vision is not None
    other = engine.vision.pixels([square(BLUE)])
    swapped = learner_logprobs(engine, prompts, [other], out, chunked=False)[0]
    np.testing.assert_allclose(same, out[0][0].logprobs, atol=1e-4)
    assert np.abs(swapped - same).max() > 1e-3


def test_engine_refuses_images_it_cannot_place(engine: HFEngine) -> None:
    assert engine.vision is not None
    ids, vision = engine.vision.encode("colour?", [square(RED)])
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="image placeholder"):
        first = ids.index(engine.vision.image_token_id)
        engine.generate([ids[:first] + ids[first + 1 :]], sampling, images=[vision])  # one short
    with pytest.raises(ValueError, match="image placeholder"):
        engine.generate([ids], sampling, images=[None])
    text = engine.vision.tokenizer("say a:")["input_ids"]
    (only,) = engine.generate([text], sampling)  # a text prompt takes the batch path as before
    assert len(only[0].token_ids) >= 1
