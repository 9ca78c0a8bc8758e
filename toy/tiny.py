"""Tiny checkpoints built locally: a Qwen2-architecture causal LM (or a Qwen3-MoE one, or a Qwen2-VL
vision-language one), a character tokenizer, a scalar-head model.

Nothing here touches a hub. The models are random-weight but real Hugging Face checkpoints saved with
``save_pretrained``, so every engine and the learner load them by path exactly as they would a 7B model.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeForSequenceClassification,
)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
# Characters of every shipped toy task and the chat template: digits, lowercase, a little punctuation.
ALPHABET = list(string.digits + string.ascii_lowercase + " :=+-*?,.!'\n")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# The byte-level variant's template renders tools and tool calls itself (docs/environments.md §10.8), compactly:
# the tools as one line of names, a call as the Hermes block the model writes, a tool result as a turn.
TOOLS_CHAT_TEMPLATE = (  # newlines as {{ '\\n' }}: a template's newline right after a tag is trimmed
    "{% if tools %}system: tools: {% for t in tools %}{{ t['function']['name'] }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}assistant: "
    "{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{{ '\\n' }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _byte_level(ch: str) -> str:
    """GPT-2/Qwen2 byte-level spelling of a one-byte character (space is 'Ġ', newline is 'Ċ')."""
    (b,) = ch.encode()
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges (one token per character), made with `tokenizers`.

    It has the same pipeline as Qwen2's own tokenizer (byte-level pre-tokenisation, BPE), so transformers'
    ``Qwen2Tokenizer`` reloads it faithfully by path, as it would a real Qwen2 checkpoint's.
    """
    return _byte_level_bpe([_byte_level(ch) for ch in ALPHABET], CHAT_TEMPLATE)


def build_byte_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE over all 256 bytes, no merges: any text (JSON tool calls included) round-trips, one
    token per byte. Its chat template renders tools (:data:`TOOLS_CHAT_TEMPLATE`) unless one is given."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return _byte_level_bpe(alphabet, chat_template or TOOLS_CHAT_TEMPLATE)


def _byte_level_bpe(tokens: list[str], chat_template: str) -> PreTrainedTokenizerFast:
    """The special tokens, then ``tokens`` (byte-level symbols), as a BPE without merges."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({tok: len(SPECIALS) + i for i, tok in enumerate(tokens)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def tiny_config(
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_pos: int = 512,
    head_dim: int | None = None,
) -> Qwen2Config:
    """``head_dim`` (default ``hidden // heads``) re-divides ``hidden`` into ``hidden // head_dim`` heads, half
    as many KV heads: vLLM's CPU attention kernel takes head_dim 32, 64, ... but not the default 16."""
    if head_dim is not None:
        if head_dim <= 0 or hidden % head_dim:
            raise ValueError(f"head_dim {head_dim} does not divide hidden {hidden}")
        heads = hidden // head_dim
        kv_heads = max(1, heads // 2)
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        **_special_ids(),
        torch_dtype="float32",
    )


def _special_ids() -> dict[str, int]:
    """The model config's ids of the tokenizer's special tokens (the order of ``SPECIALS``)."""
    return {
        "pad_token_id": SPECIALS.index(PAD),
        "bos_token_id": SPECIALS.index(BOS),
        "eos_token_id": SPECIALS.index(EOS),
    }


def tiny_moe_config(
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    head_dim: int | None = None,
    experts: int = 8,
    top_k: int = 2,
    max_pos: int = 512,
) -> Qwen3MoeConfig:
    """A Qwen3-MoE (Qwen3-30B-A3B's architecture) at toy size: every layer's MLP is ``experts`` experts of
    width ``hidden`` of which each token uses ``top_k``. ``head_dim`` defaults to 32 (vLLM's CPU attention
    needs at least that), so ``hidden // 32`` heads, half as many KV heads."""
    head_dim = head_dim or 32
    if head_dim <= 0 or hidden % head_dim:
        raise ValueError(f"head_dim {head_dim} does not divide hidden {hidden}")
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in 1..experts ({experts})")
    heads = hidden // head_dim
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,  # of dense MLP layers (mlp_only_layers); none here
        moe_intermediate_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,  # as Qwen3-30B-A3B: the top-k weights renormalised to sum to 1
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        **_special_ids(),
        torch_dtype="float32",
    )


# The Qwen2-VL tokens the model config names, added to the byte-level tokenizer as special tokens.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VL_SPECIALS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# A message's content is a string or a list of parts; an image part becomes one placeholder between the
# vision markers (the processor expands it to the image's patch count), as Qwen2-VL's own template does.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
VL_IMAGE_SIDE = 56  # pixels: 56x56 is 4x4 patches of 14, merged 2x2 into 4 image tokens
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Qwen2-VL's vision tokens after its bytes, and a template placing images."""
    tok = build_byte_tokenizer(VL_CHAT_TEMPLATE)
    tok.add_tokens(VL_SPECIALS, special_tokens=True)
    return tok


def tiny_vl_config(
    vocab_size: int, token_ids: dict[str, int], *, hidden: int = 64, layers: int = 2, head_dim: int = 32
) -> Qwen2VLConfig:
    """A Qwen2-VL at toy size: the text model as :func:`tiny_config` with ``head_dim`` 32 (vLLM's CPU
    attention needs at least that), a one-block vision tower of width 32 whose merger projects to
    ``hidden``. M-RoPE splits the head's 16 rotary frequencies 4/6/6 over time, height and width (Qwen2-VL's
    own 16/24/24 at head_dim 128, scaled)."""
    if head_dim <= 0 or hidden % head_dim or head_dim % 8:
        raise ValueError(f"head_dim {head_dim} must divide hidden {hidden} and be a multiple of 8")
    heads = hidden // head_dim
    half = head_dim // 2
    section = [half // 4, (half - half // 4) // 2]
    section.append(half - sum(section))
    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        "tie_word_embeddings": True,
        **_special_ids(),
    }
    vision = {
        "depth": 1,
        "embed_dim": 32,
        "num_heads": 1,
        "mlp_ratio": 2,
        "hidden_size": hidden,  # the merger's output: the text model's width
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=True,
        **_special_ids(),
        torch_dtype="float32",
    )


def make_tiny_vl(out: Path, *, seed: int, hidden: int, layers: int, head_dim: int | None) -> dict[str, Path]:
    """``actor/``: a random-init Qwen2-VL with its tokenizer and an image processor sized for 56x56 images.

    No critic: Qwen2-VL has no sequence-classification head in transformers (GRPO runs need none). The
    image processor is the PIL one (transformers' default needs torchvision); ``processor_config.json``
    and ``video_preprocessor_config.json`` complete the processor files, so ``AutoProcessor`` loads them
    where torchvision is installed (tandem itself reads them with :class:`tandem.vision.VisionProcessor`).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIALS}
    cfg = tiny_vl_config(len(tokenizer), ids, hidden=hidden, layers=layers, head_dim=head_dim or 32)
    torch.manual_seed(seed)
    actor = Qwen2VLForConditionalGeneration(cfg)
    path = out / "actor"
    actor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pixels = VL_IMAGE_SIDE * VL_IMAGE_SIDE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels,
        max_pixels=pixels,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
    )
    image_processor.save_pretrained(path)
    sizes = {"shortest_edge": pixels, "longest_edge": pixels}
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "size": sizes, "patch_size": PATCH}
    video |= {"merge_size": MERGE, "temporal_patch_size": TEMPORAL_PATCH}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    processor = {"processor_class": "Qwen2VLProcessor", "chat_template": VL_CHAT_TEMPLATE}
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return {"actor": path}


ARCHS = ("qwen2", "qwen3-moe", "qwen2-vl")


def make_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tokenizer: str = "chars",
    arch: str = "qwen2",
) -> dict[str, Path]:
    """Build and save ``actor/`` (causal LM) and ``critic/`` (scalar head; doubles as a reward model).

    Returns the paths. Idempotent in content: the same seed gives the same weights. ``head_dim`` as in
    :func:`tiny_config` (``head_dim=32``: the same size, 2 heads of 32, loadable by vLLM's CPU build).
    ``vocab_size`` pads the embedding and the (tied) head to that many rows while the tokenizer keeps its
    small vocabulary, as real checkpoints carry unused rows (Qwen2's 151,936 rows for ~151,650 tokens):
    a model with a real vocabulary's head cost at a tiny model's trunk cost. ``tokenizer="bytes"``: the
    byte-level tokenizer whose template renders tools (:func:`build_byte_tokenizer`), for tool calling.
    ``arch="qwen3-moe"``: a mixture-of-experts model, 8 experts, top-2 (:func:`tiny_moe_config`).
    ``arch="qwen2-vl"``: a vision-language actor only, byte-level tokenizer (:func:`make_tiny_vl`).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    out = Path(out_dir)
    if arch == "qwen2-vl":
        if vocab_size is not None:
            raise ValueError("--vocab-size is not supported for qwen2-vl")
        return make_tiny_vl(out, seed=seed, hidden=hidden, layers=layers, head_dim=head_dim)
    tokenizer = build_byte_tokenizer() if tokenizer == "bytes" else build_tokenizer()
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    vocab = vocab_size or len(tokenizer)
    if arch == "qwen3-moe":
        cfg = tiny_moe_config(vocab, hidden=hidden, layers=layers, head_dim=head_dim)
        lm, seq_cls = Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification
    else:
        cfg = tiny_config(vocab, hidden=hidden, layers=layers, head_dim=head_dim)
        lm, seq_cls = Qwen2ForCausalLM, Qwen2ForSequenceClassification
    torch.manual_seed(seed)
    actor = lm(cfg)
    torch.manual_seed(seed + 1)
    critic_cfg = type(cfg).from_dict(
        {**cfg.to_dict(), "num_labels": 1, "id2label": {0: "score"}, "label2id": {"score": 0}}
    )
    critic = seq_cls(critic_cfg)
    paths = {"actor": out / "actor", "critic": out / "critic"}
    for name, model in (("actor", actor), ("critic", critic)):
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def make_tiny_lora(
    base: str | Path, out: str | Path, *, rank: int, seed: int, b_scale: float = 1.0, **config: object
) -> Path:
    """A random LoRA of ``base`` on every linear layer, saved by peft's ``save_pretrained`` into ``out``.

    A and B are both random (peft's ``init_lora_weights=False``; its default B = 0 would be no change), B
    multiplied by ``b_scale``; ``config``: more ``LoraConfig`` fields (``use_dora``, ``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    model.save_pretrained(out)
    return Path(out)


def ensure_demo_assets(root: str | Path) -> None:
    """Build what ``configs/tiny.yaml`` loads (``assets/tiny`` and ``assets/echo.jsonl`` under ``root``)
    when missing, as ``make assets`` does: so a benchmark runs on a fresh checkout."""
    from tandem.data import write_prompts
    from toy.tasks import make_records

    assets = Path(root) / "assets"
    if not (assets / "tiny" / "actor" / "config.json").is_file():
        print(f"[tandem] building {assets / 'tiny'}", flush=True)
        make_tiny(assets / "tiny")
    if not (assets / "echo.jsonl").is_file():
        write_prompts(assets / "echo.jsonl", make_records("echo", 2000))
