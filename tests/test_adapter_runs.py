"""Several LoRA adapters trained at once (``learner.lora.adapters``): each adapter a run of its own, what is
refused with it, and the run as a whole's line. The run itself is ``configs/tiny-multilora.yaml`` in the
presets tier (tests/test_presets.py), which checks each adapter trained on its own prompts only."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.adapter_runs import round_stats
from tandem.config import ConfigError, adapter_run_dir, load_config

PRESET = Path(__file__).resolve().parent.parent / "configs" / "tiny-multilora.yaml"


def test_each_adapter_is_a_run_of_its_own_with_its_prompts_rewards_and_learning_rate() -> None:
    cfg = load_config(PRESET, ["run.name=mix", "run.seed=3", "learner.checkpoint_dir=/ckpt"])
    runs = cfg.adapter_runs()
    assert list(runs) == ["echo", "reverse"]
    echo, reverse = runs["echo"], runs["reverse"]
    assert (echo.run.name, reverse.run.name) == ("mix.echo", "mix.reverse")  # each its own Redis keys
    assert echo.data.prompts == cfg.data.prompts and reverse.data.prompts.endswith("assets/reverse.jsonl")
    assert [f.path for f in echo.reward.functions] == ["toy.tasks.echo:reward"]
    assert [f.path for f in reverse.reward.functions] == ["toy.tasks.reverse:reward"]
    assert (echo.learner.actor_lr, reverse.learner.actor_lr) == (5e-3, cfg.learner.actor_lr)
    assert echo.run.seed == reverse.run.seed == 3
    assert echo.learner.checkpoint_dir == "/ckpt/echo" and reverse.learner.checkpoint_dir == "/ckpt/reverse"
    assert echo.learner.lora.adapters == [] and echo.learner.lora.rank == cfg.learner.lora.rank
    assert adapter_run_dir("/runs/mix", "echo") == Path("/runs/mix/adapters/echo")
    assert load_config(PRESET, ["learner.lora.adapters=[]"]).adapter_runs() == {}


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("learner.lora.modules_to_save=[norm]", "learner.lora.modules_to_save=[]"),
        ("learner.lora.sync=merged", "learner.lora.sync=adapter"),
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef=0"),
        ("learner.num_ranks=2", "learner.num_ranks=1"),
        ("placement.mode=auto", "placement.mode=separate"),
        ("learner.lora.adapters=[{name: a}, {name: a}]", "given more than once: ['a']"),
        ("learner.lora.adapters=[{name: a/b}]", "name"),
    ],
)
def test_what_several_adapters_do_not_run_with_is_refused_naming_it(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=r"learner\.lora\.adapters") as e:
        load_config(PRESET, [override])
    assert named in str(e.value)


def test_several_adapters_run_on_hf_and_vllm_and_not_on_sglang() -> None:
    assert load_config(PRESET, ["rollout.engine=vllm"]).learner.lora.adapters
    with pytest.raises(ConfigError, match=r"rollout\.engine=sglang"):
        load_config(PRESET, ["rollout.engine=sglang"])


def test_the_runs_line_is_the_step_every_adapter_reached_and_the_mean_of_their_rewards() -> None:
    stats = {
        "echo": {
            "learner/version": 7,
            "reward/mean": 0.2,
            "staleness/mean": 1.0,
            "throughput/train_tokens_per_s": 10,
        },
        "reverse": {
            "learner/version": 6,
            "reward/mean": 0.6,
            "staleness/mean": 2.0,
            "throughput/train_tokens_per_s": 5,
        },
    }
    line = round_stats(stats)
    assert line["learner/version"] == 6
    assert line["reward/mean"] == pytest.approx(0.4)
    assert (line["echo/reward/mean"], line["reverse/reward/mean"]) == (0.2, 0.6)
    assert line["staleness/mean"] == pytest.approx(1.5) and line["throughput/train_tokens_per_s"] == 15
    assert "reward/mean" not in round_stats({"echo": {"learner/version": 0}})  # nothing logged yet


def test_the_frozen_base_is_held_once_and_each_adapter_stays_its_own(tiny_ckpt: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from learner.adapter_runs import share_frozen_base
    from learner.lora import wrap
    from tandem.config import LoRAConfig

    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(wrap(AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]), LoRAConfig(rank=2)))
    for p in models[1].parameters():  # as training would: the adapters move off peft's zero B
        if p.requires_grad:
            p.data.normal_()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = [m(input_ids=ids).logits for m in models]
    frozen = sum(p.numel() * p.element_size() for p in models[1].parameters() if not p.requires_grad)
    assert share_frozen_base(models) == frozen > 0
    named = [dict(m.named_parameters()) for m in models]
    for name, p in named[1].items():
        assert (p.data_ptr() == named[0][name].data_ptr()) == (not p.requires_grad), name
    for m, logits in zip(models, before, strict=True):
        assert torch.equal(m(input_ids=ids).logits, logits)
    assert not torch.equal(before[0], before[1])  # the adapters differ, and still do
    assert share_frozen_base(models) == 0  # shared already


def test_the_runs_stop_key_asks_every_adapters_run_to_stop(redis_client, run_id: str) -> None:
    """``{run}:stop`` set by hand stops a run with adapters as it stops any run: the launcher's tick passes
    it on to each adapter's run, whose learner and rollout loops watch their own key."""
    from launcher.driver import tick
    from tandem.telemetry import stop_key

    cfg = load_config(PRESET, [f"run.name={run_id}"])
    polled: list[bool] = []

    class Up:  # the launcher's Redis keeper, feeder and backend, as far as tick uses them
        up = True

        def tick(self) -> None:
            return None

        def top_up(self) -> None:
            return None

        def poll(self, *, stopping: bool) -> None:
            polled.append(stopping)

    adapters = [stop_key(f"{run_id}.{a.name}") for a in cfg.learner.lora.adapters]
    tick(cfg, Up(), redis_client, Up(), Up())
    assert redis_client.exists(*adapters) == 0 and polled == [False]
    redis_client.set(stop_key(run_id), "1")
    tick(cfg, Up(), redis_client, Up(), Up())
    assert redis_client.exists(*adapters) == len(adapters) == 2 and polled == [False, True]
