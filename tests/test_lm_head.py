"""The chunked output head (``learner/lm_head.py``) against the plain logits path it replaces.

Losses and gradients (w.r.t. the last hidden states and the head weight, tied or untied, with a bias, at
temperatures other than 1 and at 0, through a mask) must match the plain path within 1e-5 relative, on
random tiny Qwen2 models; a PPO learner step must give the same losses and weights with it on and off.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from buffer.schema import Trajectory
from learner import lora
from learner.advantages import masked_mean
from learner.batch import budget_sizes, make_batch, micro_batches, response_view, split_to
from learner.lm_head import chunk_tokens, chunked_logprobs_entropy
from learner.losses import entropy_from_logits, logprobs_from_logits
from learner.models import load_models, output_head, policy_logits, policy_logprobs
from learner.online import peak_memory_gb
from learner.ppo import PPOLearner
from tandem.config import ConfigError, LoRAConfig, load_config
from tests.test_learner import group, raw_config
from toy.tiny import make_tiny
from weightsync import named_full_parameters

RTOL = 1e-5
VOCAB = 300


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within 1e-5 relative, elementwise and to the tensor's scale (entries near 0 have no digits)."""
    atol = RTOL * float(want.detach().abs().max())
    got, want = got.detach(), want.detach()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")


def random_lm(*, tied: bool, seed: int = 0) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units, as a trained model has (init gives ~0.1)
        model.lm_head.weight.mul_(20.0)
    return model


def ppo_like_loss(logp: torch.Tensor, entropy: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor):
    """A policy-gradient-shaped loss that reads both outputs through the mask."""
    return masked_mean(-weight * logp, mask) - 0.3 * masked_mean(entropy, mask)


def tiny_batch(seed: int = 0):
    trajs = [t for g in range(3) for t in group(g, 3, seed=seed)]
    trajs[4].finish_reason = "abort"  # a fully masked row
    return make_batch(trajs, 0)


# ------------------------------------------------------------------------------------- the function alone


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("bias", [False, True])
def test_function_matches_plain_logits(temperature: float, bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    n, h, v = 23, 16, 97
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = (0.5 * torch.randn(v, h, generator=gen)).requires_grad_()
    b = (0.5 * torch.randn(v, generator=gen)).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.3).float()
    adv = torch.randn(n, generator=gen)
    inputs = [hidden, weight] + ([b] if bias else [])

    logits = torch.nn.functional.linear(hidden, weight, b).float()
    logits = logits / temperature if temperature > 0 else logits
    want_lp = logprobs_from_logits(logits[None], labels[None])[0]
    want_ent = entropy_from_logits(logits[None])[0]
    want = ppo_like_loss(want_lp, want_ent, adv, mask)
    want_grads = torch.autograd.grad(want, inputs)

    lp, ent = chunked_logprobs_entropy(hidden, weight, labels, bias=b, temperature=temperature, chunk=5)
    got = ppo_like_loss(lp, ent, adv, mask)
    got_grads = torch.autograd.grad(got, inputs)

    assert_close(lp, want_lp, "logp")
    assert_close(ent, want_ent, "entropy")
    assert_close(got, want, "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=False):
        assert_close(g, w, f"grad {name}")


def test_logprob_only_and_entropy_only_gradients() -> None:
    """Each output's gradient alone (the other unused): the scoring passes and an entropy bonus."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 8, generator=gen, requires_grad=True)
    weight = torch.randn(40, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 40, (11,), generator=gen)
    for pick in (0, 1):
        logits = (hidden @ weight.T) / 1.3
        want_out = (logprobs_from_logits(logits[None], labels[None])[0], entropy_from_logits(logits[None])[0])
        want = torch.autograd.grad(want_out[pick].sum(), [hidden, weight])
        got_out = chunked_logprobs_entropy(hidden, weight, labels, temperature=1.3, chunk=4)
        got = torch.autograd.grad(got_out[pick].sum(), [hidden, weight])
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, f"output {pick}")
    lp, ent = chunked_logprobs_entropy(hidden, weight, labels, with_entropy=False)
    assert torch.all(ent == 0) and not ent.requires_grad and lp.requires_grad


def test_chunk_tokens_bounds_the_chunk() -> None:
    assert chunk_tokens(151_936, 1 << 24) == 110
    assert chunk_tokens(151_936, 10) == 1  # never zero tokens
    assert chunk_tokens(52, 1 << 24) == (1 << 24) // 52


# ------------------------------------------------------------------------------- on a real causal LM


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_model_path_matches_plain_logits(tied: bool, temperature: float) -> None:
    """policy_logprobs (hidden states of the model's own forward, mask, response view) against
    policy_logits + losses: the same loss and the same gradient on every parameter and on the hidden
    states, tied head (gradient shared with the embedding) or not."""
    batch = tiny_batch()
    results = {}
    for path in ("plain", "chunked"):
        model = random_lm(tied=tied)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        loss = torch.zeros(())
        captured: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor, captured=captured) -> None:
            out.retain_grad()  # the last hidden states (after the final norm)
            captured.append(out)

        hook = model.model.norm.register_forward_hook(keep)
        for mb in micro_batches(batch, torch.arange(len(batch)), 4, "pad", torch.device("cpu")):
            mask = batch.mask[mb.rows]
            adv = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
            if path == "plain":
                logits = response_view(policy_logits(model, mb, temperature), mb)
                lp, ent = logprobs_from_logits(logits, mb.targets), entropy_from_logits(logits)
            else:
                head = output_head(model)
                assert head is model.lm_head
                lp, ent = policy_logprobs(
                    model, mb, temperature, mask, head, chunk_logits=VOCAB * 3, with_entropy=True
                )
            mb_loss = ppo_like_loss(lp, ent, adv, mask)
            mb_loss.backward()
            loss = loss + mb_loss.detach()
        hook.remove()
        grads_h = [h.grad for h in captured]
        results[path] = (loss, grads_h, {n: p.grad for n, p in model.named_parameters()})
    (loss_p, gh_p, gp_p), (loss_c, gh_c, gp_c) = results["plain"], results["chunked"]
    assert_close(loss_c, loss_p, "loss")
    for g, w in zip(gh_c, gh_p, strict=True):
        assert_close(g, w, "grad hidden")
    assert gp_p.keys() == gp_c.keys()
    for name in gp_p:
        assert_close(gp_c[name], gp_p[name], f"grad {name}")
    assert float(gp_p["lm_head.weight" if not tied else "model.embed_tokens.weight"].abs().max()) > 0


def test_lora_actor_uses_the_chunked_head_with_its_adapters() -> None:
    """A LoRA actor with a frozen head: the trunk runs with its adapters, only they get gradients."""
    batch = tiny_batch(seed=1)
    mb = micro_batches(batch, torch.arange(len(batch)), 9, "pad", torch.device("cpu"))[0]
    mask = batch.mask[mb.rows]
    grads = {}
    for path in ("plain", "chunked"):
        model = lora.wrap(random_lm(tied=True), LoRAConfig(rank=4, alpha=8))
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: make the adapters matter
                p.data = torch.randn(p.shape, generator=gen) * 0.1
        if path == "plain":
            logits = response_view(policy_logits(model, mb, 0.8), mb)
            lp, ent = logprobs_from_logits(logits, mb.targets), entropy_from_logits(logits)
        else:
            head = output_head(model)
            assert head is not None and not head.weight.requires_grad
            lp, ent = policy_logprobs(model, mb, 0.8, mask, head, chunk_logits=VOCAB * 4, with_entropy=True)
        ppo_like_loss(lp, ent, torch.ones_like(mask), mask).backward()
        grads[path] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["plain"] and all("lora_" in n for n in grads["plain"])
    for name, want in grads["plain"].items():
        assert_close(grads["chunked"][name], want, f"grad {name}")


def test_an_adapted_head_keeps_the_plain_path() -> None:
    model = lora.wrap(random_lm(tied=False), LoRAConfig(rank=4, alpha=8, target_modules=["lm_head"]))
    assert output_head(model) is None


def test_a_forward_without_logits_to_keep_keeps_the_plain_path() -> None:
    """Asked per class, once: an older remote-code forward cannot give logits at one position only."""

    class OlderForward(Qwen2ForCausalLM):
        def forward(self, input_ids=None, position_ids=None, use_cache=None, output_hidden_states=None):
            return super().forward(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    plain = random_lm(tied=True)
    assert output_head(plain) is plain.lm_head
    assert output_head(OlderForward(plain.config)) is None
    assert output_head(plain) is plain.lm_head


# ------------------------------------------------------------------------------------- the learner step


@pytest.fixture(scope="module")
def padded_ckpt(tmp_path_factory):
    """The tiny checkpoint with its head padded to VOCAB rows (``make-tiny --vocab-size``)."""
    paths = make_tiny(tmp_path_factory.mktemp("tiny-padded"), vocab_size=VOCAB)
    return paths


def test_make_tiny_pads_embedding_and_head(padded_ckpt) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(padded_ckpt["actor"])
    assert model.get_input_embeddings().num_embeddings == VOCAB
    assert model.get_output_embeddings().out_features == VOCAB
    assert len(AutoTokenizer.from_pretrained(padded_ckpt["actor"])) < VOCAB
    with pytest.raises(ValueError, match="below the tokenizer"):
        make_tiny(padded_ckpt["actor"].parent / "bad", vocab_size=10)


def learner_step(
    padded_ckpt, tmp_path, monkeypatch, name: str, **learner_cfg
) -> tuple[dict, dict, dict, list[int | None]]:
    """One ``train`` of a PPO learner on a fixed batch: (stats, weights before, weights after, one entry
    per chunked-head call)."""
    raw = raw_config(
        padded_ckpt, "redis://unused", name, tmp_path / name, data={"max_prompt_tokens": 8},
        rollout={"temperature": 0.7, "n_samples": 4, "max_new_tokens": 16},
        algorithm={"kl_coef": 0.1, "entropy_coef": 0.05, "ppo_epochs": 2, "minibatch_size": 4},
        learner={"chunked_head_threshold": 0, "chunked_head_chunk": VOCAB * 5, **learner_cfg},
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    learner = PPOLearner(cfg, tmp_path / name)
    learner.models = load_models(cfg, learner.device)
    calls: list[int | None] = []
    import learner.ppo as ppo

    real = ppo.policy_logprobs

    # per call, the head weight's elements when ZeRO-3 partitions it (0: gathered only in the head's own
    # call), else None (no ZeRO-3, or the reference model, which is never partitioned)
    def spy(*a, **k):
        w = a[4].weight
        calls.append(w.numel() if hasattr(w, "ds_id") else None)
        return real(*a, **k)

    monkeypatch.setattr(ppo, "policy_logprobs", spy)
    batch = make_batch([t for g in range(2) for t in group(g, 4, seed=5)], 0)
    engine = learner.models.actor
    before = {n: p.detach().clone() for n, p in named_full_parameters(engine)}  # gathered under ZeRO-3
    stats = learner.train(batch)
    after = {n: p.detach().clone() for n, p in named_full_parameters(engine)}
    return stats, before, after, list(calls)


def test_learner_step_is_the_same_with_the_chunked_head(padded_ckpt, tmp_path, monkeypatch) -> None:
    """A whole PPO step (prox and reference passes, two epochs, KL and entropy in the loss): the same
    losses, metrics and updated weights with the chunked head on ('auto' at threshold 0) and off."""
    off, w_before, w_off, calls_off = learner_step(
        padded_ckpt, tmp_path, monkeypatch, "off", chunked_head="off"
    )
    auto, _, w_auto, calls_auto = learner_step(
        padded_ckpt, tmp_path, monkeypatch, "auto", chunked_head="auto"
    )
    assert not calls_off and calls_auto  # the chunked head did run, and only when asked
    assert_same_step(auto, w_auto, off, w_off, w_before)


def test_learner_step_under_zero3_gathers_the_head(padded_ckpt, tmp_path, monkeypatch) -> None:
    """ZeRO-3 (one rank, nothing kept gathered between uses): the chunked head runs as the head module's
    call, so DeepSpeed gathers the partitioned weight for its forward and its backward and takes its
    gradient like any other; the step equals the plain one."""
    zero3 = {"zero_stage": 3, "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    off, w_before, w_off, calls_off = learner_step(
        padded_ckpt, tmp_path, monkeypatch, "z3-off", chunked_head="off", **zero3
    )
    on, _, w_on, calls_on = learner_step(
        padded_ckpt, tmp_path, monkeypatch, "z3-on", chunked_head="on", **zero3
    )
    assert not calls_off and 0 in calls_on and set(calls_on) <= {0, None}  # partitioned until its call
    assert_same_step(on, w_on, off, w_off, w_before)


def assert_same_step(got: dict, w_got: dict, want: dict, w_want: dict, w_before: dict) -> None:
    for key in ("loss/policy", "loss/kl", "policy/kl", "policy/entropy", "policy/approx_kl"):
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=RTOL * 1e-2, err_msg=key)
    assert want["loss/kl"] != 0 and want["policy/approx_kl"] != 0  # the second epoch moved the policy
    # Adam divides each gradient by its own scale, so where a gradient is ~0 its rounding noise sets the
    # step: weights agree to a small fraction of one step (lr), not to 1e-5 of their size.
    lr = 1e-2
    for name, w in w_want.items():
        torch.testing.assert_close(w_got[name], w, rtol=RTOL, atol=1e-2 * lr, msg=name)
        assert not torch.equal(w, w_before[name]), name  # every weight was trained


def test_auto_keeps_plain_logits_below_the_threshold(padded_ckpt, tmp_path, monkeypatch) -> None:
    raw = raw_config(padded_ckpt, "redis://unused", "below", tmp_path)
    cfg = load_config(None, raw=raw)  # default threshold: 2^26 logits, far above this batch
    learner = PPOLearner(cfg, tmp_path)
    learner.models = load_models(cfg, learner.device)
    import learner.ppo as ppo

    monkeypatch.setattr(ppo, "policy_logprobs", lambda *a, **k: pytest.fail("chunked below threshold"))
    learner.train(make_batch(group(0, 8), 0))


def test_peak_memory_is_per_step() -> None:
    cpu = torch.device("cpu")
    peak_memory_gb(cpu)
    x = torch.ones(1 << 27)  # 0.5 GiB
    x.add_(1)
    with_x = peak_memory_gb(cpu)
    del x
    peak_memory_gb(cpu)  # the interval that freed x still saw it
    assert peak_memory_gb(cpu) < with_x - 0.4


# ------------------------------------------------------------------------------ token-budget micro-batches


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_budget_sizes_keep_every_pass_within_the_budget(layout: str) -> None:
    assert budget_sizes([10, 8, 8, 3, 2, 2], 24, "pad") == [2, 3, 1]
    assert budget_sizes([10, 8, 8, 3, 2, 2], 24, "pack") == [2, 4]
    assert budget_sizes([50, 3], 24, layout) == [1, 1]  # too long for the budget: a pass of its own
    rng = np.random.default_rng(0)
    for _ in range(50):
        lens = sorted(rng.integers(1, 40, size=rng.integers(1, 30)).tolist(), reverse=True)
        budget = int(rng.integers(20, 120))
        sizes = budget_sizes(lens, budget, layout)
        assert sum(sizes) == len(lens) and min(sizes) >= 1
        start = 0
        for n in sizes:
            group_lens = lens[start : start + n]
            cost = n * group_lens[0] if layout == "pad" else sum(group_lens)
            assert cost <= budget or n == 1
            # greedy: the next row would not have fitted
            if start + n < len(lens):
                more = lens[start : start + n + 1]
                assert ((n + 1) * more[0] if layout == "pad" else sum(more)) > budget
            start += n


def test_split_to_equalises_the_pass_count() -> None:
    assert split_to([3, 1], 4) == [1, 1, 1, 1]
    assert split_to([5, 2], 3) == [3, 2, 2]
    assert split_to([2, 1], 2) == [2, 1]
    assert split_to([1, 1], 3) == [1, 1]  # cannot split single rows


def test_token_budget_gives_the_same_step(padded_ckpt, tmp_path, monkeypatch) -> None:
    """Micro-batches by a token budget: the same losses and updated weights as by rows, and no pass
    reads more than the budget (unless it holds a single sequence)."""
    budget = 24
    seen: list[tuple[int, int]] = []
    real_micro = PPOLearner.micro

    def spy(self: PPOLearner, batch, rows):
        out = real_micro(self, batch, rows)
        seen.extend((mb.input_ids.numel(), len(mb.rows)) for mb in out)
        return out

    monkeypatch.setattr(PPOLearner, "micro", spy)
    rows, w_before, w_rows, _ = learner_step(padded_ckpt, tmp_path, monkeypatch, "rows", chunked_head="off")
    by_rows = list(seen)
    seen.clear()
    tokens, _, w_tokens, _ = learner_step(
        padded_ckpt, tmp_path, monkeypatch, "tokens", chunked_head="off", max_tokens_per_micro_batch=budget
    )
    assert all(n <= budget or k == 1 for n, k in seen), seen
    assert len(seen) > len(by_rows)  # the budget did split differently
    assert_same_step(tokens, w_tokens, rows, w_rows, w_before)


def test_token_budget_gives_every_rank_the_same_number_of_passes(padded_ckpt, tmp_path) -> None:
    """Ranks split their shares by the same budget, then to the largest count: ZeRO-3 needs every rank
    to run as many forward passes as the others. Shares stay disjoint and cover the batch."""
    raw = raw_config(
        padded_ckpt, "redis://unused", "ranks", tmp_path, data={"max_prompt_tokens": 8},
        rollout={"max_new_tokens": 32}, learner={"max_tokens_per_micro_batch": 40},
    )  # fmt: skip
    learner = PPOLearner(load_config(None, raw=raw), tmp_path)
    trajs = group(0, 4, seed=7) + group(1, 4, seed=8)
    long = trajs[0]  # one long sequence: its rank needs more passes
    trajs[0] = Trajectory(
        traj_id=long.traj_id, group_id=long.group_id, prompt_id=long.prompt_id,
        prompt_tokens=long.prompt_tokens, response_tokens=np.arange(4, 34),
        behav_logp=np.zeros(30, dtype=np.float32), token_versions=np.zeros(30, dtype=np.int64), reward=1.0,
    )  # fmt: skip
    batch = make_batch(trajs, 0)
    rows = torch.arange(len(batch))
    per_rank = []
    for rank in range(2):  # the rows each of 2 data-parallel ranks takes
        learner.sp = replace(learner.sp, dp_rank=rank, dp_world=2)
        per_rank.append(learner.micro(batch, rows))
    unsplit = [
        budget_sizes(
            batch.seq_lens[rows[torch.argsort(batch.seq_lens, descending=True, stable=True)][r::2]].tolist(),
            40,
            "pad",
        )
        for r in range(2)
    ]
    assert len(unsplit[0]) != len(unsplit[1])  # the shares alone would disagree
    assert len(per_rank[0]) == len(per_rank[1])
    got = sorted(int(i) for mbs in per_rank for mb in mbs for i in mb.rows)
    assert got == list(range(len(batch)))
    assert all(mb.input_ids.numel() <= 40 or len(mb.rows) == 1 for mbs in per_rank for mb in mbs)


def test_auto_decides_by_the_nominal_micro_batch(padded_ckpt, tmp_path, monkeypatch) -> None:
    """auto compares the nominal micro-batch (micro_batch_size x the batch's width) with the threshold,
    not its actual rows: a short last micro-batch, or another rank's, takes the same path."""
    batch = make_batch(group(0, 6, seed=2), 0)
    width = batch.mask.shape[1]
    raw = raw_config(
        padded_ckpt, "redis://unused", "nominal", tmp_path,
        algorithm={"batch_size": 8, "minibatch_size": 8},
        learner={"micro_batch_size": 4, "chunked_head_threshold": VOCAB * 4 * width - 1},
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    learner = PPOLearner(cfg, tmp_path)
    learner.models = load_models(cfg, learner.device)
    import learner.ppo as ppo

    calls = []
    real = ppo.policy_logprobs
    monkeypatch.setattr(ppo, "policy_logprobs", lambda *a, **k: calls.append(len(a[1].rows)) or real(*a, **k))
    for mb in learner.micro(batch, torch.arange(len(batch))):
        learner.logprobs(learner.models.actor, mb, batch.mask[mb.rows])
    assert calls == [4, 2]


# --------------------------------------------------------------------------- trajectories over the budget


@pytest.mark.parametrize(
    ("sections", "error"),
    [
        ({}, r"\(24\) is below .* data.max_prompt_tokens \(8\) \+ rollout.max_new_tokens \(32\) = 40"),
        ({"env": {"path": "m:Env", "max_total_tokens": 30}}, r"\(24\) is below .*env.max_total_tokens = 30"),
        ({"data": {"max_prompt_tokens": 30}, "env": {"path": "m:Env", "max_total_tokens": 20}},
         r"\(24\) is below .*data.max_prompt_tokens \(above env.max_total_tokens\) = 30"),
    ],
)  # fmt: skip
def test_config_refuses_a_budget_below_the_longest_trajectory(padded_ckpt, tmp_path, sections, error) -> None:
    raw = raw_config(
        padded_ckpt, "redis://unused", "budget", tmp_path, learner={"max_tokens_per_micro_batch": 24}
    )
    raw["data"]["max_prompt_tokens"] = 8
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=r"learner.max_tokens_per_micro_batch " + error):
        load_config(None, raw=raw)
    raw["learner"]["max_tokens_per_micro_batch"] = 40
    load_config(None, raw=raw)  # at the longest: accepted


@pytest.mark.parametrize(("recipe", "longest"), [("sft", 64), ("rm", 128), ("dpo", 128)])
def test_config_refuses_an_offline_budget_below_the_longest_example(padded_ckpt, recipe, longest) -> None:
    raw = {
        "model": {"actor": str(padded_ckpt["actor"])}, "data": {"prompts": "unused.jsonl"},
        "algorithm": {"recipe": recipe, "train_file": "train.jsonl", "max_tokens": 64},
        "learner": {"max_tokens_per_micro_batch": longest - 1},
    }  # fmt: skip
    with pytest.raises(
        ConfigError, match=rf"\({longest - 1}\) is below .*algorithm.max_tokens.* = {longest}"
    ):
        load_config(None, raw=raw)
    raw["learner"]["max_tokens_per_micro_batch"] = longest
    load_config(None, raw=raw)


def test_agent_runs_have_no_cap_to_check(padded_ckpt, tmp_path) -> None:
    raw = raw_config(
        padded_ckpt, "redis://unused", "agent", tmp_path, agent={"path": "m:agent"},
        learner={"max_tokens_per_micro_batch": 8},
    )  # fmt: skip
    assert load_config(None, raw=raw).learner.max_tokens_per_micro_batch == 8


def long_trajectory(t: Trajectory, n: int) -> Trajectory:
    return Trajectory(
        traj_id=t.traj_id, group_id=t.group_id, prompt_id=t.prompt_id, prompt_tokens=t.prompt_tokens,
        response_tokens=np.arange(4, 4 + n) % 200 + 4, behav_logp=np.full(n, -3.5, dtype=np.float32),
        token_versions=np.zeros(n, dtype=np.int64), reward=t.reward,
    )  # fmt: skip


def test_make_batch_drops_a_trajectory_over_the_budget() -> None:
    trajs = group(0, 4, seed=3)
    trajs[2] = long_trajectory(trajs[2], 40)
    batch = make_batch(trajs, 0, max_tokens=24)
    assert batch.dropped.tolist() == [False, False, True, False]
    assert batch.mask[2].sum() == 0 and batch.mask[[0, 1, 3]].sum() > 0
    assert (
        batch.group_index.tolist()[:2] == [0, 0] and batch.group_index[2] not in batch.group_index[[0, 1, 3]]
    )
    assert batch.seq_lens[2] == 1  # its passes read one token
    for layout in ("pad", "pack"):
        (mb,) = micro_batches(batch, torch.arange(4), 4, layout, torch.device("cpu"))
        assert mb.input_ids.numel() <= 4 * 14
    assert make_batch(trajs, 0).dropped.tolist() == [False] * 4  # no budget, nothing dropped


def test_learner_step_masks_out_an_over_budget_trajectory(padded_ckpt, tmp_path, monkeypatch, caplog) -> None:
    """A trajectory longer than the budget arriving at run time (an agent session has no cap): the step
    trains on the rest within the budget, the long one masked out and a group of its own (its siblings'
    GRPO baseline is theirs alone, as for an aborted sample), a warning names it and batch/over_budget
    counts it."""
    from buffer.streams import Taken

    budget = 24
    raw = raw_config(
        padded_ckpt, "redis://unused", "over", tmp_path, agent={"path": "m:agent"},
        learner={"max_tokens_per_micro_batch": budget}, logging={"log_interval": 1},
    )  # fmt: skip
    learner = PPOLearner(load_config(None, raw=raw), tmp_path)
    learner.models = load_models(learner.cfg, learner.device)
    trajs = group(0, 4, seed=3) + group(1, 4, seed=4)
    trajs[1] = long_trajectory(trajs[1], 40)  # an unrewarded sample of group 0 (sample 0 is rewarded)
    logged, passes, advantages = [], [], []
    real_micro, real_estimate = learner.micro, learner.estimate
    monkeypatch.setattr(learner, "take_batch", lambda: [Taken(f"id{i}", t) for i, t in enumerate(trajs)])
    monkeypatch.setattr(learner, "sync_weights", lambda **k: None)
    monkeypatch.setattr(learner, "commit", lambda *a: None)
    monkeypatch.setattr(learner, "buffer_metrics", dict)
    monkeypatch.setattr(learner.telemetry, "log", lambda row, step: logged.append(row))
    monkeypatch.setattr(learner, "micro", lambda b, r: passes.extend(out := real_micro(b, r)) or out)
    monkeypatch.setattr(learner, "estimate", lambda x: advantages.append(out := real_estimate(x)) or out)
    with caplog.at_level("WARNING", logger="learner"):
        assert learner.step()
    assert logged[0]["batch/over_budget"] == 1.0
    assert f"trajectory 0-1: {len(trajs[1].prompt_tokens) + 40} tokens" in caplog.text
    assert "learner.max_tokens_per_micro_batch=24" in caplog.text
    assert passes and all(mb.input_ids.numel() <= budget for mb in passes)
    adv = advantages[0][0][:, 0]  # outcome advantages: the same on every token of a row
    # Group 0 is its three other samples, rewards (1, 0, 0): GRPO gives (2/3, -1/3, -1/3) / std, std = 1/√3
    # (with the long sample's 0 among them it would be (3/4, -1/4, -1/4) / 0.5).
    want = torch.tensor([2 / 3, -1 / 3, -1 / 3]) * 3**0.5
    torch.testing.assert_close(adv[[0, 2, 3]], want, rtol=1e-4, atol=1e-4)


def test_chunked_head_reads_yaml_on_and_off(padded_ckpt, tmp_path) -> None:
    """YAML reads a bare on/off as a boolean: `chunked_head: off` in a file or on the command line."""
    for value, want in ((False, "off"), (True, "on"), ("off", "off"), ("auto", "auto")):
        raw = raw_config(padded_ckpt, "redis://unused", "yaml", tmp_path, learner={"chunked_head": value})
        assert load_config(None, raw=raw).learner.chunked_head == want
