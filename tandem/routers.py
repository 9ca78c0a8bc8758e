"""The routers of a mixture-of-experts model, found generically: shared by the learner (router metrics,
routing replay) and the hf engine (recording its routing), which import nothing of each other.

transformers declares each MoE model's router class as the ``router_logits`` output recorder
(``_can_record_outputs``), the same hook ``output_router_logits=True`` uses. A dense model has none.
"""

from __future__ import annotations

from torch import nn


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The router module class transformers records ``router_logits`` from, or None for a dense model."""
    for m in model.modules():
        recorder = getattr(type(m), "_can_record_outputs", None) or {}
        spec = recorder.get("router_logits")
        if spec is not None:
            return getattr(spec, "target_class", spec)
    return None


def routers(model: nn.Module) -> list[nn.Module]:
    """Every router of ``model``, in layer order."""
    cls = router_class(model)
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]
