"""A run's path for prompts with images: the feeder's token ids, the rollout server's screen and
trajectories, the learner's micro-batches, the vision tower frozen or trained, and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from buffer.schema import PromptRecord, Trajectory, decode_prompt, encode_prompt
from launcher.feeder import PromptSet
from learner.batch import make_batch
from learner.models import load_models, vision_tower
from learner.ppo import PPOLearner
from rollout.engines.base import Completion
from rollout.loop import image_screen
from rollout.scoring import GroupScorer
from tandem.config import Config, ConfigError, load_config
from tandem.vision import VisionProcessor
from toy.tasks import colour
from toy.tiny import make_tiny


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-vl"), arch="qwen2-vl")["actor"]


@pytest.fixture(scope="module")
def processor(vl: Path) -> VisionProcessor:
    return VisionProcessor.from_pretrained(vl)


def config(actor: Path, prompts: Path, tmp: Path, **sections: dict) -> Config:
    raw = {
        "run": {"name": "vl", "device": "cpu", "seed": 0},
        "model": {"actor": str(actor)},
        "data": {"prompts": str(prompts), "chat_template": True},
        "reward": {"functions": [{"path": "toy.tasks.colour:reward"}]},
        "rollout": {"n_samples": 4, "temperature": 1.0},
        "algorithm": {"advantage": "grpo", "batch_size": 8, "minibatch_size": 8, "max_staleness": 100},
        "learner": {"micro_batch_size": 4, "actor_lr": 1e-2},
        "weightsync": {"shm_dir": str(tmp / "weights")},
        "logging": {"wandb_mode": "disabled"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return load_config(None, raw=raw)


@pytest.mark.parametrize("inline", [False, True], ids=["files", "inline"])
def test_feeder_tokenises_image_prompts_with_their_placeholders(
    vl: Path, processor: VisionProcessor, tmp_path: Path, inline: bool
) -> None:
    prompts = colour.write(tmp_path / "colour.jsonl", 3, inline=inline)
    loaded = PromptSet.load(config(vl, prompts, tmp_path))
    for rec, ids in zip(loaded.records, loaded.tokens, strict=True):
        assert ids.count(processor.image_token_id) == 4  # one 56x56 image: 4 merged patches
        (entry,) = rec["images"]
        assert entry.startswith("data:image/png;base64,") if inline else Path(entry).is_absolute()
        want, _ = processor.encode(rec["prompt"], [colour.draw(rec)])
        assert ids == want


def test_feeder_refuses_images_where_they_cannot_be_generated_from(
    vl: Path, tiny_ckpt: dict[str, Path], tmp_path: Path
) -> None:
    prompts = colour.write(tmp_path / "colour.jsonl", 2)
    with pytest.raises(ConfigError, match=r"^model\.actor: .* has no vision tower"):
        PromptSet.load(config(tiny_ckpt["actor"], prompts, tmp_path))
    with pytest.raises(ConfigError, match=r"^placement\.reference: "):
        PromptSet.load(
            config(vl, prompts, tmp_path, algorithm={"kl_coef": 0.1}, placement={"reference": "server"})
        )


def test_server_screen_reads_the_images_and_each_trajectory_carries_them(
    vl: Path, processor: VisionProcessor, tmp_path: Path
) -> None:
    prompts = colour.write(tmp_path / "colour.jsonl", 2)
    loaded = PromptSet.load(config(vl, prompts, tmp_path))
    wire = [
        decode_prompt(encode_prompt(PromptRecord(f"p{i}", r["prompt"], ids, record=r)))
        for i, (r, ids) in enumerate(zip(loaded.records, loaded.tokens, strict=True))
    ]
    screen = image_screen(lambda r: None, processor)
    assert [screen(p) for p in wire] == [None, None]
    for p, rec in zip(wire, loaded.records, strict=True):
        assert p.vision is not None
        want = processor.pixels([colour.draw(rec)])
        torch.testing.assert_close(p.vision.pixel_values, want.pixel_values)
    done = Completion([5, 6], [-1.0, -1.0], "stop", [0, 0])
    scorer = SimpleNamespace(server_id="server-0")
    traj = GroupScorer.trajectory(scorer, wire[0], done, 1.0, {}, "g")  # type: ignore[arg-type]
    np.testing.assert_array_equal(traj.pixel_values, wire[0].vision.pixel_values.numpy())
    assert traj.image_grid_thw.tolist() == [[1, 4, 4]]
    # Dead-lettered: images on an engine without a processor, placeholders the images do not fill.
    text = decode_prompt(encode_prompt(wire[1]))
    assert image_screen(lambda r: None, None)(text)[0] == "dead"
    short = PromptRecord(
        "p", text.text, [t for t in text.tokens if t != processor.image_token_id], text.record
    )
    verdict = image_screen(lambda r: None, processor)(short)
    assert verdict is not None and "placeholder" in verdict[1]


def vl_trajectories(processor: VisionProcessor, n: int = 8) -> list[Trajectory]:
    """One group per image (red, green), ``n // 2`` samples each, rewards varying within each group."""
    rng = np.random.default_rng(0)
    out = []
    for g, name in enumerate(["red", "green"]):
        rec = {"answer": name, "square": [10, 10, 30]}
        ids, vision = processor.encode(colour.PROMPT, [colour.draw(rec)])
        for i in range(n // 2):
            resp = rng.integers(97, 122, size=3)  # letters: no placeholder in a response
            out.append(
                Trajectory(
                    f"{g}-{i}",
                    f"g{g}",
                    f"p{g}",
                    np.array(ids),
                    resp,
                    np.full(3, -3.0, dtype=np.float32),
                    np.zeros(3),
                    float(i % 2),
                    **vision.arrays(),
                )
            )
    return out


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_freeze_vision_keeps_the_tower_or_trains_it(
    vl: Path, processor: VisionProcessor, tmp_path: Path, freeze: bool
) -> None:
    cfg = config(vl, tmp_path / "unused.jsonl", tmp_path, model={"freeze_vision": freeze})
    learner = PPOLearner(cfg, tmp_path)
    learner.models = load_models(cfg, learner.device)
    tower = vision_tower(learner.models.actor.module)
    assert tower is not None
    before = {k: v.detach().clone() for k, v in tower.named_parameters()}
    trajs = vl_trajectories(processor)
    batch = make_batch(trajs, 0)
    # The images reach the forward through the learner's micro-batches: others change the log-probs.
    logp = learner.score(batch)[0]
    assert logp is not None and torch.isfinite(logp).all()
    other = [*trajs[4:], *trajs[:4]]  # each row's tokens with the other group's pixels
    swapped = make_batch(
        [dataclasses.replace(t, pixel_values=o.pixel_values) for t, o in zip(trajs, other, strict=True)],
        0,
    )
    assert (learner.score(swapped)[0] - logp).abs().max() > 1e-4
    learner.train(batch)
    changed = [k for k, v in tower.named_parameters() if not torch.equal(v, before[k])]
    assert all(not p.requires_grad for p in tower.parameters()) == freeze
    assert (changed == []) == freeze


def test_a_vision_actor_takes_no_critic_and_no_packing(vl: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage=gae"):
        config(vl, tmp_path / "p.jsonl", tmp_path, algorithm={"advantage": "gae"})
    with pytest.raises(ConfigError, match=r"algorithm\.packing"):
        load_config(
            None,
            raw={
                "run": {"name": "sft", "device": "cpu"},
                "model": {"actor": str(vl)},
                "data": {"prompts": str(tmp_path / "p.jsonl")},
                "algorithm": {"recipe": "sft", "train_file": str(tmp_path / "d.jsonl"), "packing": True},
            },
        )


def test_async_at_staleness_zero_equals_sync_on_image_prompts(
    vl: Path, processor: VisionProcessor, redis_server, redis_client, tmp_path: Path
) -> None:
    """Two learners on the same image groups, async at max_staleness 0 and sync: the same losses, step by
    step (tests/test_learner.py's check, with each trajectory's pixels in its rows)."""
    import os
    import random
    import time

    from tests.test_learner import run_with_admission_producer

    def image_group(g: int, n: int, *, version: int = 0, seed: int = 0) -> list[Trajectory]:
        rng = random.Random(seed * 1000 + g)
        record = colour.make_record(rng, g)
        prompt, vision = processor.encode(colour.PROMPT, [colour.draw(record)])
        out = []
        for i in range(n):
            word = rng.choice(sorted(colour.COLOURS))
            resp = processor.tokenizer(word)["input_ids"] + [processor.tokenizer.eos_token_id]
            out.append(
                Trajectory(
                    traj_id=f"{g}-{i}", group_id=f"g{g}", prompt_id=f"p{g}", prompt_tokens=np.asarray(prompt),
                    response_tokens=np.asarray(resp), behav_logp=np.full(len(resp), -3.5, dtype=np.float32),
                    token_versions=np.full(len(resp), version), reward=float(word == record["answer"]),
                    **vision.arrays(),
                )
            )  # fmt: skip
        return out

    runs = {}
    for mode, max_staleness in (("async", 0), ("sync", 3)):  # sync forces 0 whatever the config says
        cfg = config(
            vl, tmp_path / "unused.jsonl", tmp_path / mode,
            run={"name": f"vl-eq-{mode}-{os.getpid()}-{time.monotonic_ns()}", "mode": mode},
            redis={"url": redis_server.url, "claim_idle_ms": 60_000},
            algorithm={"max_staleness": max_staleness, "minibatch_size": 4, "ppo_epochs": 2},
            learner={"total_steps": 3, "save_hf_final": False, "take_timeout_s": 60},
        )  # fmt: skip
        runs[mode] = run_with_admission_producer(cfg, redis_client, tmp_path / mode, image_group)
    for rows in runs.values():
        assert [r["learner/version"] for r in rows] == [1, 2, 3]
        assert all(r["staleness/max"] == 0 for r in rows)
    losses = {mode: [(r["loss/policy"], r["policy/entropy"]) for r in rows] for mode, rows in runs.items()}
    assert losses["async"] == losses["sync"]
    assert len({p for p, _ in losses["sync"]}) == 3  # the steps differ: the comparison is not vacuous
