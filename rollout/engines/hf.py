"""The ``hf`` engine: transformers on CPU or GPU with a hand-written, batched decode loop.

Owns one causal LM and its tokenizer. Concurrent ``generate`` calls share one running batch
(:mod:`rollout.engines.hf_batch`, continuous batching as vLLM's scheduler does it): a call's rows are
prefilled (left-padded, positions counting real tokens only) and join the batch at its next step, decode
one token per step on a ``DynamicCache`` with the others, and leave it as they finish. Each sampled token's
behaviour logprob is read from the distribution it was drawn from (temperature, then top-k, then top-p,
renormalised; :mod:`rollout.engines.sampling`), so the learner's importance weights see exactly what was
sampled (AReaL's decoupled PPO needs ``behav_logp``, docs/design.md §8.2).

Writing the loop ourselves buys PipelineRL's in-flight weight updates: the ``between_steps`` hook runs
between decode steps and may swap the weights in place; later tokens carry the new version. The KV cache
of the tokens already generated stays as the old weights computed it, as in PipelineRL: recomputing it
would cost a prefill of every running sequence per update, and the learner corrects for the mismatch
with the importance weight like for any other stale token.

Each finished row's KV stays in a prefix cache (:mod:`rollout.engines.hf_prefix`, sized by
``rollout.hf_prefix_cache_mb``): a later call whose row extends a cached sequence prefills only the rest,
as vLLM's prefix cache does, so a multi-turn episode's next turn feeds just its new tokens. Every weight
update and ``sleep`` empty it.

One lock serialises the model between the rollout loop, the HTTP API and weight updates. It is held per
decode step, not per call, so an update lands between two steps of every running row.

One call's failure is its own: rows are sampled group by group, and a group that fails (non-finite
logits, a sampler error) is sampled again call by call; a call that still fails ends with
:class:`SamplingFailed` and its rows leave the batch, while the other calls' rows decode on. Only a
failed forward, whose KV cache is then unknown, fails every call in the batch.

LoRA adapters given by name (``loras``, the standalone server's ``--lora NAME=DIR``) are served beside the
base model: a call names one in ``SamplingParams.adapter``, and rows of different adapters share the batch's
steps, each with its own adapter (peft's mixed-batch forward, :mod:`rollout.engines.hf_lora`).

A vision-language checkpoint (Qwen2-VL; ``vision_config`` in its config) loads as one, with its
:class:`tandem.vision.VisionProcessor` as ``self.vision``. Its text prompts take the path above; a call
whose prompts carry images (``generate(..., images=...)``: each prompt's pixel values and grid sizes, its
token ids already holding the expanded placeholders) decodes in a loop of its own
(:meth:`HFEngine._generate_vision`): the images' 3-D (M-RoPE) positions are computed once at prefill and
each generated token's position is offset by them, which the running batch's 1-D positions cannot carry.
It holds the lock per step like the batch, so weight updates still land between steps, but it does not
share steps with other calls and keeps nothing in the prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    DynamicCache,
    DynamicLayer,
    PreTrainedTokenizerBase,
)

from buffer.schema import routed_dtype
from rollout.engines.base import BetweenSteps, Completion, EngineStats, OnPrompt, OnToken, SamplingParams
from rollout.engines.constraint import Grammars, advance
from rollout.engines.devices import release_freed_memory, resolve_device, resolve_dtype
from rollout.engines.hf_batch import WAIT_POLL_S, Entry, Request, RunningBatch, sample_groups
from rollout.engines.hf_lora import BASE, load_adapters, prefix_seed, row_adapters, write_adapter
from rollout.engines.hf_prefix import LayerKV, PrefixCache, PrefixStats, left_padded_kv, prefix_hashes
from rollout.engines.sampling import sample_tokens
from tandem.config import RolloutConfig
from tandem.routers import routers
from tandem.vision import (
    SUPPRESSED_LOGIT,
    VisionInputs,
    VisionProcessor,
    is_vision_checkpoint,
    mm_token_type_ids,
    placeholder_ids,
)
from weightsync.adapters import apply_adapter, is_adapter_tensor
from weightsync.base import Update, WeightSyncError

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_MB: float = RolloutConfig.model_fields["hf_prefix_cache_mb"].default
GREEDY_BELOW = 1e-5  # a lower temperature samples greedily, as in vLLM and the HTTP API


class SamplingFailed(ValueError):
    """One call's rows could not be sampled; the call fails alone and its batch-mates go on."""


def _same_storage_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


class HFEngine:
    """transformers inference engine implementing :class:`rollout.engines.base.Engine`."""

    continuous_batching = True  # calls running at once share decode steps (rollout/engines/hf_batch.py)
    supports_sleep = True  # frees its parameters' storage (sleep / wake_up)

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        seed: int = 0,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        zero_copy: bool = False,
        gather_s: float = 0.0,
        record_routing: bool = False,
        loras: Mapping[str, str | LoraConfig] | None = None,
    ) -> None:
        """``zero_copy``: a full update's tensors become the weights rather than being copied into them
        (:meth:`update_weights`); for a colocated engine that sleeps before each new version. ``gather_s``:
        how long a call that finds the engine idle waits for others to join it before the first step
        (episodes' turns and agents' calls; 0 for a single-turn run, whose batch arrives whole).
        ``record_routing``: each completion carries the experts every MoE router chose for each fed position
        (``Completion.routed_experts``, for routing replay); it turns the prefix cache off, since a cached
        prefix is never routed again. ``loras``: LoRA adapters served beside the base model, name -> peft
        directory (or a ``LoraConfig``: empty until :meth:`update_adapter`); a call takes one by
        ``SamplingParams.adapter`` (rollout/engines/hf_lora.py)."""
        self.device = resolve_device(str(device) if device is not None else None)
        self.zero_copy = zero_copy
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=trust_remote_code
        )
        # A vision-language checkpoint: its processor for image prompts, its class for the vision tower.
        self.vision: VisionProcessor | None = None
        auto = AutoModelForCausalLM
        if is_vision_checkpoint(model_path):
            self.vision = VisionProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            auto = AutoModelForImageTextToText
        self.model = auto.from_pretrained(
            model_path, dtype=resolve_dtype(dtype, self.device), trust_remote_code=trust_remote_code
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.text_config = self.model.config.get_text_config()  # the config itself for a causal LM
        # A vision-language policy never writes an image placeholder (tandem/vision.py SUPPRESSED_LOGIT).
        ids = placeholder_ids(self.model.config)
        self._suppress = torch.tensor(ids, device=self.device) if ids else None
        self.max_positions: int | None = self.text_config.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {i for i in [*eos_ids, self.tokenizer.eos_token_id] if i is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
        # Every name a state_dict may use, tied aliases (lm_head.weight) included.
        self._tensors = {
            **dict(self.model.named_parameters(remove_duplicate=False)),
            **dict(self.model.named_buffers(remove_duplicate=False)),
        }
        self._parameters = list(self.model.named_parameters())  # what a full update must cover, once
        self._shape_of = {name: tuple(t.shape) for name, t in self._tensors.items()}  # also while released
        self._lora_base: dict[str, torch.Tensor] = {}  # each adapted layer's W0 (weightsync/adapters.py)
        self._lock = threading.Lock()
        self.gather_s = gather_s
        self._batch = RunningBatch()  # every call's rows, decoding together
        self._caches_lock = threading.Lock()  # the batch's members change, stats() reads them
        self._running = threading.Event()
        self._running.set()
        self._version = 0
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self._released: set[str] = set()  # what sleep() freed and wake_up() has not restored
        self._unfilled = False  # weights re-allocated by wake_up, not yet filled by a full update
        self._routing: list[torch.Tensor] = []  # one forward's chosen experts, (rows * t, k) per router
        self._routing_hooks = self._record_routing() if record_routing else []
        self.record_routing = bool(self._routing_hooks)
        self.prefix_cache = self._make_prefix_cache(0.0 if self.record_routing else prefix_cache_mb)
        self._grammars: Grammars | None = None  # built at the first constrained call
        self.prefilled_tokens = 0  # real tokens fed by prefills (cached prefixes not counted)
        # Loaded after the name -> tensor map above: peft keeps each adapted layer's weight as it is.
        self.adapters: tuple[str, ...] = tuple(loras or ())
        self._served = load_adapters(self.model, loras) if loras else None
        self._adapter_versions = dict.fromkeys(self.adapters, 0)  # each served adapter's weight version
        self._active_adapter: str | None = None  # peft's active adapter, for forwards of one adapter's rows

    def _record_routing(self) -> list[torch.utils.hooks.RemovableHandle]:
        """A forward hook on each router (found as learner/moe.py finds them) keeping its top-k indices."""
        found = routers(self.model)
        if not found:
            raise ValueError(
                "hf engine: recording routing needs a mixture-of-experts model; this one has no router"
            )

        self._routed_dtype = routed_dtype(int(found[0].num_experts))

        def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            self._routing.append(output[2])  # (router_logits, router_scores, router_indices)

        return [r.register_forward_hook(hook) for r in found]

    def _take_routing(self, entries: list[Entry], fed: torch.Tensor) -> None:
        """Append each entry's routed experts of the forward just run: ``fed`` (B, t) marks its real positions."""
        layers, self._routing = self._routing, []
        if not self.record_routing:
            return
        b, t = fed.shape
        routed = torch.stack(layers, dim=1).reshape(b, t, len(layers), -1)  # (B, t, layers, k)
        routed, fed = routed.cpu().numpy().astype(self._routed_dtype), fed.bool().cpu().numpy()
        for i, e in enumerate(entries):
            e.routing.append(routed[i][fed[i]])

    def _make_prefix_cache(self, mb: float) -> PrefixCache | None:
        """None when ``mb`` is 0, or when a layer's cache is not plain (a sliding window keeps only its
        window's KV, so a row's whole KV cannot be read back)."""
        if mb < 0:
            raise ValueError(f"rollout.hf_prefix_cache_mb must be >= 0 (got {mb})")
        if mb == 0:
            return None
        layers = DynamicCache(config=self.model.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            log.info(
                "hf engine: no prefix cache for %s (not every layer caches all positions)", type(layers[0])
            )
            return None
        return PrefixCache(int(mb * (1 << 20)))

    def prefix_stats(self) -> PrefixStats | None:
        """Lookups, hits and reused tokens of the prefix cache; None when it is off."""
        return self.prefix_cache.stats if self.prefix_cache is not None else None

    @property
    def version(self) -> int:
        return self._version

    def adapter_version(self, name: str) -> int:
        """The weight version of served adapter ``name`` (0 until :meth:`update_adapter` first loads it)."""
        return self._adapter_versions[name]

    def stats(self) -> EngineStats:
        """Bytes of the running batch's KV cache, its rows, and the rows waiting to join it at the next step.

        There is no fixed pool, so no usage share. Nothing is ever preempted: a row keeps its KV until it
        finishes (running out of memory is an error, not a preemption), so ``preemptions`` is 0 by
        construction.
        """
        with self._caches_lock:
            batch = self._batch
            return EngineStats(
                kv_cache_bytes=batch.kv_nbytes(),
                preemptions=0,
                requests_running=len(batch),
                requests_waiting=len(batch.pending),
            )

    # ------------------------------------------------------------------------------------------ generate

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
        on_prompt: OnPrompt | None = None,
        images: Sequence[VisionInputs | None] | None = None,
    ) -> list[list[Completion]]:
        """``images``: a vision-language model's inputs for each prompt that has images (None for one that
        has none); its token ids hold the expanded image placeholders (:meth:`VisionProcessor.encode`)."""
        self._check(prompts, sampling)
        if 0 < sampling.temperature < GREEDY_BELOW:  # logits / 1e-300 are inf and NaN
            sampling = dataclasses.replace(sampling, temperature=0.0)
        generator = self._rng
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        if images is not None or self.vision is not None:  # (a text model's text call: no cost)
            with_images = self._check_images(prompts, images, sampling)
            if with_images is not None:
                if sampling.adapter is not None:
                    raise ValueError("a LoRA adapter takes no image prompts here yet; ask the base model")
                return self._generate_vision(
                    prompts, with_images, sampling, generator, between_steps, on_token, on_prompt
                )
        rows = [list(p) for p in prompts for _ in range(sampling.n)]
        request = Request(rows, sampling, generator, self._stop_ids(sampling), on_token, on_prompt)
        if sampling.constraint is not None:
            request.grammar = self._compile(sampling)
        flat = self._decode(request, between_steps)
        n = sampling.n
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _check(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        self._check_awake()
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise ValueError(
                f"n and max_new_tokens must be >= 1 (got {sampling.n}, {sampling.max_new_tokens})"
            )
        t, top_p = sampling.temperature, sampling.top_p
        if (
            not (math.isfinite(t) and t >= 0 and math.isfinite(top_p) and 0 < top_p <= 1)
            or sampling.top_k < 0
        ):
            raise ValueError("temperature must be finite and >= 0, top_p in (0, 1], top_k >= 0")
        if sampling.adapter is not None and sampling.adapter not in self.adapters:
            served = ", ".join(self.adapters) or "none"
            raise ValueError(f"LoRA adapter {sampling.adapter!r} is not served here (served: {served})")
        vocab = self.text_config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
            if self.max_positions is not None and len(p) + sampling.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} it "
                    f"exceeds the model's context of {self.max_positions}"
                )

    def _check_awake(self) -> None:
        if self._released or self._unfilled:
            raise RuntimeError(
                "hf engine: its weights are released (placement.release_memory, asleep while the learner "
                "trains); wake_up and a full weight update come before generate"
            )

    def _check_images(
        self,
        prompts: list[list[int]],
        images: Sequence[VisionInputs | None] | None,
        sampling: SamplingParams,
    ) -> Sequence[VisionInputs | None] | None:
        """``images`` when some prompt has images, None when none has. Each prompt's placeholder tokens
        must be as many as its images fill: a placeholder without pixels would be read as a plain token."""
        given = images is not None and any(v is not None for v in images)
        if self.vision is None:
            if given:
                raise ValueError("this model has no vision tower: its prompts cannot carry images")
            return None
        images = images if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image inputs for {len(prompts)} prompts")
        token = self.vision.image_token_id
        for i, (p, v) in enumerate(zip(prompts, images, strict=True)):
            want = 0 if v is None else v.placeholders(self.vision.merge_size)
            if (have := sum(t == token for t in p)) != want:
                raise ValueError(f"prompt {i} has {have} image placeholder tokens; its images fill {want}")
        if given and sampling.constraint is not None:
            raise ValueError("constrained decoding of prompts with images is not supported")
        return images if given else None

    def _generate_vision(
        self,
        prompts: list[list[int]],
        images: Sequence[VisionInputs | None],
        sampling: SamplingParams,
        generator: torch.Generator,
        between_steps: BetweenSteps | None,
        on_token: OnToken | None,
        on_prompt: OnPrompt | None,
    ) -> list[list[Completion]]:
        """Prompts with images, decoded together in a loop of their own (module docs): a prefill with the
        pixel values and 3-D positions, then one token per step at position ``length + delta + step``,
        ``delta`` being how far the images moved the row's next position. Rows that finish early ride
        along (masked out of nothing, their tokens ignored) until the last one does."""
        n = sampling.n
        rows = [list(p) for p in prompts for _ in range(n)]
        row_images = [v for v in images for _ in range(n) if v is not None]
        vision = VisionInputs.concat(row_images).to(self.device)
        stop_ids = self._stop_ids(sampling)
        ids, mask = self._left_pad(rows)
        padded = not bool(mask.all())
        assert self.vision is not None
        types = mm_token_type_ids(ids, self.vision.image_token_id)
        model = self.model.model
        positions, deltas = model.get_rope_index(ids, types, vision.image_grid_thw, attention_mask=mask)
        next_pos = mask.sum(-1) + deltas.squeeze(-1)  # (B,): the first generated token's position
        cache = DynamicCache(config=self.model.config)
        out: list[Completion] = [Completion([], [], "length", []) for _ in rows]
        done = [False] * len(rows)
        reported = [False] * len(prompts)
        with self._lock:
            self._check_awake()  # asleep since the call began? checked under the lock
            logits = self._forward(
                ids,
                mask if padded else None,
                positions,
                cache,
                pixel_values=vision.pixel_values,
                image_grid_thw=vision.image_grid_thw,
                mm_token_type_ids=types,
            )
            version = self._version
        step = 0
        while True:
            tokens, logps = _checked_sample(logits, sampling, generator)
            for j, (token, logp) in enumerate(zip(tokens.tolist(), logps.tolist(), strict=True)):
                if done[j]:
                    continue
                stopped = self._append(out[j], token, logp, version, stop_ids, sampling.stop)
                if on_token is not None:
                    on_token(j, token, logp)
                done[j] = stopped or len(out[j].token_ids) >= sampling.max_new_tokens
            for i in range(len(prompts)):
                if not reported[i] and all(done[i * n : (i + 1) * n]):
                    reported[i] = True
                    if on_prompt is not None:
                        on_prompt(i, out[i * n : (i + 1) * n])
            if all(done):
                break
            if between_steps is not None:
                between_steps()  # may apply a weight update: the next step uses the new weights
            self._running.wait()  # pause() holds generation here until resume()
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            pos = (next_pos + step).view(1, -1, 1).expand(3, -1, 1)
            step += 1
            with self._lock:
                self._check_awake()
                logits = self._forward(tokens[:, None], mask if padded else None, pos, cache)
                version = self._version
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _compile(self, sampling: SamplingParams) -> object:
        """The call's constraint compiled against this tokenizer (rollout/engines/constraint.py); an invalid
        one is a ``ValueError``."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.text_config.vocab_size, self.eos_token_ids)
        assert sampling.constraint is not None
        try:
            return self._grammars.compile(sampling.constraint)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"the request's constraint does not compile: {e}") from None

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        return frozenset(self.eos_token_ids | set(sampling.stop_token_ids))

    def _decode(self, request: Request, between_steps: BetweenSteps | None) -> list[Completion]:
        """Put the call's rows in the running batch and drive it until they have finished (module docs of
        :mod:`rollout.engines.hf_batch`): a step whenever this thread holds the lock, then its own hook;
        each prompt is reported as its rows finish."""
        batch = self._batch
        with self._lock:
            batch.pending += [
                Entry(request, i, [], 0, Grammars.matcher(request.grammar) if request.grammar else None)
                for i in range(len(request.rows))
            ]
        try:
            while not request.finished.is_set():
                with self._lock:
                    driving = batch.take_wheel(request)
                if driving:
                    self._running.wait()  # pause() holds generation here, outside the lock, until resume()
                    if self.gather_s and not len(batch):
                        time.sleep(self.gather_s)  # an idle batch: let the calls of this moment join it
                    with self._lock:  # per step, so weight updates land between two steps of every row
                        if not request.finished.is_set():
                            self._step()
                elif not request.wake.wait(WAIT_POLL_S):  # another call's thread steps these rows too
                    with self._lock:
                        batch.take_over(request)
                request.wake.clear()
                self._report(request)
                if between_steps is not None and not request.finished.is_set():
                    if driving:
                        batch.hooked = request
                    try:
                        between_steps()  # may apply a weight update: the next forward uses the new weights
                    finally:
                        if batch.hooked is request:
                            batch.hooked = None
        except BaseException:
            with self._lock:
                batch.withdraw(request)
            raise
        finally:
            with self._lock:
                batch.hand_off(request)
        if request.error is not None:
            raise request.error
        self._report(request)  # the prompts the last step finished
        return request.out

    def _report(self, request: Request) -> None:
        """Hand the call's finished prompts to its ``on_prompt``, from the call's own thread."""
        if request.on_prompt is None or not request.done:
            return
        with self._lock:
            done, request.done = request.done, []
        for prompt in done:
            request.on_prompt(prompt, request.prompt_completions(prompt))

    def _step(self) -> None:
        """One step of the running batch: decode its rows, admit the waiting ones, record every token."""
        batch = self._batch
        version, adapter_versions = self._version, dict(self._adapter_versions)
        try:
            running = len(batch)
            picks: list[tuple[torch.Tensor, torch.Tensor]] = []
            if running:
                ids, mask, positions, cache = batch.decode_inputs()
                adapters = [e.request.sampling.adapter for e in batch.entries]
                picks.append(
                    self._sample(batch.entries, self._forward(ids, mask, positions, cache, adapters))
                )
                self._take_routing(batch.entries, torch.ones_like(ids))
            if batch.pending:
                joining, batch.pending = batch.pending, []
                # Under the lock: the cached KV and this forward see the same weights.
                epoch = self.prefix_cache.epoch if self.prefix_cache is not None else 0
                adapters = [e.request.sampling.adapter for e in joining]
                ids, mask, positions, cache, hashes = self._prefill_inputs(
                    [e.request.rows[e.row] for e in joining], adapters
                )
                for e, h in zip(joining, hashes, strict=True):
                    e.hashes, e.epoch = h, epoch
                # No padding (one GRPO group, or an episode round's rows hitting alike): plain causal
                # attention, and transformers builds no 4-D mask.
                logits = self._forward(ids, None if bool(mask.all()) else mask, positions, cache, adapters)
                self._take_routing(joining, mask[:, mask.shape[1] - ids.shape[1] :])
                tokens, logps = self._sample(joining, logits)
                picks.append((tokens, logps))
                with self._caches_lock:
                    batch.join(joining, cache, mask, positions[:, -1:], tokens[:, None])
            tokens = torch.cat([t for t, _ in picks]) if len(picks) > 1 else picks[0][0]
            logps = torch.cat([lp for _, lp in picks]) if len(picks) > 1 else picks[0][1]
            if running:
                batch.next_ids[:running] = tokens[:running, None]
        except BaseException as e:
            batch.fail_all(e)
            raise
        keep = []
        for j, (e, token, logp) in enumerate(
            zip(batch.entries, tokens.tolist(), logps.tolist(), strict=True)
        ):
            if isinstance(e.request.error, SamplingFailed):  # its call failed at this step: the row leaves
                continue
            c, s = e.completion, e.request.sampling
            if e.matcher is not None:
                advance(e.matcher, token)
            v = version if s.adapter is None else adapter_versions[s.adapter]
            stopped = self._append(c, token, logp, v, e.request.stop_ids, s.stop)
            if e.request.on_token is not None:
                e.request.on_token(e.row, token, logp)
            if not stopped and len(c.token_ids) < s.max_new_tokens:
                keep.append(j)
                continue
            if e.routing:
                c.routed_experts = np.concatenate(e.routing)
            row = e.request.rows[e.row]
            self._keep_prefix(row + c.token_ids[:-1], e.hashes, batch.cache, batch.mask[j], j, e.epoch)
            e.request.row_done(e.row)
        with self._caches_lock:
            batch.keep(keep)

    def _sample(self, entries: list[Entry], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token and behaviour logprob, sampled by its own call's settings. (B, V) -> (B,), (B,).

        A group of rows that fails is sampled again call by call; a call that still fails is finished with
        :class:`SamplingFailed` (its rows get token 0 here and leave the batch in :meth:`_step`).

        A constrained row's logits are masked to what its grammar allows first, and its logprob is read
        from that masked distribution (rollout/engines/constraint.py says why)."""
        if any(e.matcher is not None for e in entries):
            assert self._grammars is not None
            logits = self._grammars.mask(logits, [e.matcher for e in entries])
        groups = sample_groups(entries)
        if len(groups) == 1:
            try:
                return _sample_rows(logits, entries[0].request)
            except Exception:
                pass  # sampled again below, call by call
        tokens = torch.zeros(len(entries), dtype=torch.long, device=logits.device)
        logps = torch.zeros(len(entries), dtype=torch.float32, device=logits.device)
        for group in groups:
            if len(groups) > 1:  # (one group already failed whole above)
                idx = torch.tensor(group, device=logits.device)
                try:
                    tokens[idx], logps[idx] = _sample_rows(logits[idx], entries[group[0]].request)
                    continue
                except Exception:
                    pass  # sampled again call by call
            for rows in _by_request(entries, group):
                request = entries[rows[0]].request
                idx = torch.tensor(rows, device=logits.device)
                try:
                    tokens[idx], logps[idx] = _sample_rows(logits[idx], request)
                except Exception as e:
                    log.warning("hf engine: a call failed alone: %s", e)
                    request.finish(SamplingFailed(f"sampling failed for this request: {e}"))
        return tokens, logps

    def _prefill_inputs(
        self, rows: list[list[int]], adapters: Sequence[str | None]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache, list[list[int]]]:
        """The prefill's ids (B, S), mask (B, C + S), positions (B, S), cache (C columns), and each row's
        prefix hashes (for storing it later; empty without a prefix cache), seeded by the row's adapter.

        Each row's cached prefix (``c_i`` tokens) sits left-padded in the cache and the rest of the row
        (its suffix) left-padded in the ids: ``[pad, cached, pad, suffix]``, both paddings masked, positions
        ``c_i + index in the suffix`` (real tokens only). No hit: C = 0, plain left padding."""
        cache = self.prefix_cache
        hashes: list[list[int]] = [[] for _ in rows]
        hits: list[tuple[int, LayerKV] | None] = [None] * len(rows)
        if cache is not None:
            seeds = [prefix_seed(a, self.adapters) for a in adapters]
            hashes = [prefix_hashes(r, (seed,)) for r, seed in zip(rows, seeds, strict=True)]
            hits = [cache.longest(r, h) for r, h in zip(rows, hashes, strict=True)]
        if any(hit is not None for hit in hits):
            kv, cached = left_padded_kv(hits)
            kv_cache = DynamicCache(kv, config=self.model.config)
            cache_mask = torch.zeros((len(rows), kv[0][0].shape[2]), dtype=torch.long)
            for i, c in enumerate(cached):
                cache_mask[i, cache_mask.shape[1] - c :] = 1
        else:
            cached = [0] * len(rows)
            kv_cache = DynamicCache(config=self.model.config)
            cache_mask = torch.zeros((len(rows), 0), dtype=torch.long)
        ids, suffix_mask = self._left_pad([r[c:] for r, c in zip(rows, cached, strict=True)])
        offset = torch.tensor(cached, device=self.device)[:, None]  # (B, 1)
        positions = offset + (suffix_mask.cumsum(-1) - 1).clamp(min=0)  # (B, S): padding shifts nothing
        self.prefilled_tokens += int(suffix_mask.sum())
        mask = torch.cat([cache_mask.to(self.device), suffix_mask], dim=-1)
        return ids, mask, positions, kv_cache, hashes

    def _keep_prefix(
        self,
        tokens: list[int],
        row_hashes: list[int],
        cache: DynamicCache,
        mask: torch.Tensor,
        j: int,
        epoch: int,
    ) -> None:
        """Store batch entry ``j``'s KV (its real columns: ``mask`` (T,)) for ``tokens`` (whose row's prefix
        hashes are ``row_hashes``) in the prefix cache; refused there if a weight update came since
        ``epoch``."""
        if self.prefix_cache is None or self.prefix_cache.epoch != epoch:
            return
        if len(tokens) == mask.shape[0]:  # no padding: a plain copy, cheaper than gathering columns
            kv = [(layer.keys[j].clone(), layer.values[j].clone()) for layer in cache.layers]
        else:
            cols = mask.bool()
            kv = [(layer.keys[j][:, cols], layer.values[j][:, cols]) for layer in cache.layers]
        self.prefix_cache.insert(tokens, kv, epoch, prefix_hashes(tokens, row_hashes))

    def _append(
        self, c: Completion, token: int, logp: float, version: int, stop_ids: set[int], stop: list[str]
    ) -> bool:
        """Record one sampled token; True when the sequence has finished with it."""
        c.token_ids.append(token)
        c.logprobs.append(logp)
        c.versions.append(version)
        if token in stop_ids or (stop and self._ends_with_stop(c.token_ids, stop)):
            c.finish_reason = "stop"
            return True
        return False

    def _ends_with_stop(self, token_ids: list[int], stop: list[str]) -> bool:
        # A character spans at most 4 byte-level tokens; decode just enough of the tail to see any stop.
        tail = token_ids[-(4 * max(map(len, stop)) + 4) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in text for s in stop)

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: DynamicCache,
        adapters: Sequence[str | None] = (),
        **vision: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the last position; ``mask`` None when no row is padded (causal attention). ``vision``:
        a prompt's image inputs, with 3-D positions ``(3, B, t)`` (so the model keeps no rope state).
        ``adapters``: each row's served LoRA adapter (None: the base model), with adapters served.

        Shapes: ids/positions (B, t), mask (B, T_total) -> (B, V)."""
        self._routing = []  # what a failed forward left
        model, served = self.model, {}
        if self._served is not None:  # each row its own adapter (hf_lora.py)
            model, served = self._served, self._adapters_for(adapters or [None] * len(input_ids))
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **served,
            **vision,
        )
        return self._suppressed(out.logits[:, -1].float())

    def _adapters_for(self, adapters: Sequence[str | None]) -> dict[str, list[str]]:
        """The forward's extra arguments for rows taking ``adapters``: peft's mixed batch, unless every row
        takes the same adapter: then peft's plain path with that adapter active, which costs far less per
        layer than sorting the rows out (bench/multi_lora.py). (Rows of the base model alone take the mixed
        path too: it skips the base's rows at once, where switching every adapter off costs more.)"""
        assert self._served is not None
        rows = row_adapters(adapters)
        if len(set(rows)) > 1 or rows[0] == BASE:
            return {"adapter_names": rows}
        if self._active_adapter != rows[0]:  # (under the lock, as every forward is)
            self._served.set_adapter(rows[0], inference_mode=True)
            self._active_adapter = rows[0]
        return {}

    def _suppressed(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, V) with a vision-language model's placeholder tokens at SUPPRESSED_LOGIT."""
        if self._suppress is not None:
            logits[:, self._suppress] = SUPPRESSED_LOGIT
        return logits

    # ------------------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, update: Update) -> None:
        """Copy ``update.tensors()`` into the model by state_dict name; tied aliases may be absent.

        An adapter-only update (a LoRA actor's ``lora_A``/``lora_B``/``lora_scaling`` tensors) instead sets
        each adapted weight to ``W0 + scaling · B @ A`` from the weights this engine loaded.
        """
        start = time.perf_counter()
        with self._lock:
            self._clear_prefix_cache()  # computed by the old weights (a failed update leaves them mixed)
            seen: set[int] = set()
            adapter: dict[str, torch.Tensor] = {}
            for name, tensor in update.tensors():
                if is_adapter_tensor(name):  # a LoRA actor's adapter-only update (weightsync/adapters.py)
                    adapter[name] = tensor
                    continue
                target = self._tensors.get(name)
                if target is None:
                    raise WeightSyncError(f"update v{update.version}: the model has no tensor named {name!r}")
                if self._shape_of[name] != tuple(tensor.shape):
                    raise WeightSyncError(
                        f"update v{update.version}: {name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {self._shape_of[name]}"
                    )
                if self.zero_copy:
                    # Rebind, never write: the update's views (shm file pages) are read-only. Storage of
                    # another dtype or device is a fresh copy.
                    target.data = tensor if _same_storage_kind(tensor, target) else tensor.to(target)
                else:
                    target.copy_(tensor)  # converts dtype and device
                seen.add(id(target))
            if adapter:
                try:
                    apply_adapter(adapter, self._tensors, self._lora_base)
                except (KeyError, ValueError) as e:
                    raise WeightSyncError(f"update v{update.version}: {e}") from None
            missing = [n for n, p in self._parameters if id(p) not in seen]
            if self._unfilled and (missing or adapter):
                raise WeightSyncError(
                    f"update v{update.version}: the weights were released while asleep and only a full "
                    "update refills them (an adapter-only update needs placement.release_memory=false)"
                )
            self._unfilled = False
            if missing and not adapter:
                raise WeightSyncError(
                    f"update v{update.version}: {len(missing)} parameters missing, e.g. {missing[:3]}; "
                    "the model now mixes versions"
                )
            self._version = update.version
        log.debug("applied weights v%d in %.3fs", update.version, time.perf_counter() - start)

    @torch.no_grad()
    def update_adapter(self, name: str, update: Update) -> None:
        """Load an adapter-only update (a LoRA actor's ``lora_A``/``lora_B``/``lora_scaling``) into served
        adapter ``name``: its rows decode with it from the next step, the base and other adapters untouched."""
        if name not in self._adapter_versions:
            raise WeightSyncError(f"update v{update.version}: no served adapter named {name!r}")
        with self._lock:
            self._clear_prefix_cache()  # (one adapter's entries would do; updates are rare next to steps)
            try:
                write_adapter(self.model, name, dict(update.tensors()))
            except ValueError as e:
                raise WeightSyncError(f"update v{update.version}: {e}") from None
            self._adapter_versions[name] = update.version

    # ------------------------------------------------------------------------------ sleep (colocated runs)

    def sleep(self) -> None:
        """Free the parameters' storage while the learner trains (docs/placement.md §11.1).

        Only the parameters go: non-persistent buffers (rotary ``inv_freq``) stay, and a tied weight is
        one Parameter under two names, so it stays tied. The decode KV cache lives only inside a
        ``generate`` call, so there is none to free between batches, and the prefix cache is emptied.
        Nothing is kept aside: the next version's full weights refill the storage after :meth:`wake_up`.
        """
        with self._lock:
            if "weights" not in self._released:
                for p in self._parameters_only():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._released = {"weights", "kv_cache"}
            self._clear_prefix_cache()
        release_freed_memory(self.device)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what ``tags`` names (``weights``, ``kv_cache``; None: both), vLLM's ``wake_up``.

        The weights come back uninitialised: ``generate`` is refused until a full ``update_weights``
        fills them. ``kv_cache`` only ends the sleep (the decode cache is per call; the prefix cache refills as
        calls finish)."""
        with self._lock:
            for tag in tags or ("weights", "kv_cache"):
                if tag not in ("weights", "kv_cache"):
                    raise ValueError(f"wake_up: unknown tag {tag!r} (weights, kv_cache)")
                if tag == "weights" and "weights" in self._released:
                    if not self.zero_copy:  # else the next full update's tensors become the weights
                        for name, p in self._parameters:
                            p.data = torch.empty(self._shape_of[name], dtype=p.dtype, device=p.device)
                    self._unfilled = True
                self._released.discard(tag)

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def _clear_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _parameters_only(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._parameters]

    # -------------------------------------------------------------------------------------------- control

    def pause(self) -> None:
        """Hold generation at the next decode step until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._running.set()
        with self._lock:
            self.model = None  # type: ignore[assignment]
            self._tensors, self._parameters = {}, []
            self._clear_prefix_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sample_rows(logits: torch.Tensor, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` for rows of one sampling group (:func:`_checked_sample`)."""
    return _checked_sample(logits, request.sampling, request.generator)


def _checked_sample(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens``, refusing NaN or +inf logits (CUDA's sampler would assert on them and poison the
    device; -inf is a masked token) and a non-finite behaviour logprob."""
    if not bool((logits < float("inf")).all()):
        raise ValueError("the model's logits hold NaN or +inf")
    tokens, logps = sample_tokens(logits, sampling, generator)
    if not bool(torch.isfinite(logps).all()):
        raise ValueError("a sampled token has a non-finite logprob")
    return tokens, logps


def _by_request(entries: list[Entry], rows: list[int]) -> Iterator[list[int]]:
    """``rows`` (batch indices) split by the call they belong to, first seen first."""
    out: dict[int, list[int]] = {}
    for j in rows:
        out.setdefault(id(entries[j].request), []).append(j)
    yield from out.values()
