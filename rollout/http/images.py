"""Images in chat requests: OpenAI ``image_url`` content parts, for a vision-language model (docs/design.md §8.4).

A user message's ``content`` may be a list of ``{"type": "text", "text"}`` and ``{"type": "image_url",
"image_url": {"url"}}`` parts. The URL must be a ``data:image/<type>;base64,`` URL: the server downloads
nothing and reads no file a client names. The parts reach the chat template in their order, an image as
``{"type": "image"}`` (which Qwen2-VL's template renders as its placeholder); each placeholder is then
expanded to the tokens its image fills, and the engine generates from the pixels, as the rollout loop does
for a prompt record's images.

Each problem is a 400 naming the part (``messages.0.content.1.image_url.url``): an image for a model without
a vision tower, an image outside a user message, a URL that is not a data URL, bytes that are not an
image. Agent sessions take no images yet (400).
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from rollout.http.schemas import APIError, ChatMessage, ChatRequest
from tandem.vision import IMAGE_PART, ImageError, VisionProcessor, load_image


def image_parts(req: ChatRequest) -> list[tuple[str, str, Any]]:
    """``(param, role, part)`` for every ``image_url`` part of the request's messages, in order."""
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            out += [
                (f"messages.{i}.content.{j}", m.role, p)
                for j, p in enumerate(m.content)
                if p.get("type") == "image_url"
            ]
    return out


def template_content(m: ChatMessage) -> str | list[dict[str, Any]]:
    """A message's content as a chat template takes it: its text, or with images its parts in order."""
    if not isinstance(m.content, list) or not any(p.get("type") == "image_url" for p in m.content):
        return m.text()
    return [
        IMAGE_PART if p.get("type") == "image_url" else {"type": "text", "text": p["text"]}
        for p in m.content
        if p.get("type") == "image_url" or (p.get("type") == "text" and isinstance(p.get("text"), str))
    ]


def read_images(req: ChatRequest, vision: VisionProcessor | None) -> list[Image.Image]:
    """The request's images, decoded (none for a request without ``image_url`` parts); 400 naming the part
    for each problem."""
    images = []
    for param, role, part in image_parts(req):
        if vision is None:
            raise APIError(400, f"{param}: this model has no vision tower; it takes no images", param=param)
        if role != "user":
            raise APIError(400, f"{param}: images go in user messages (this one is {role!r})", param=param)
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else None
        param += ".image_url.url"
        if not isinstance(url, str) or not url:
            raise APIError(400, f"{param}: must be a data:image/<type>;base64, URL string", param=param)
        if url[:5].lower() != "data:":
            raise APIError(
                400,
                f"{param}: only data:image/<type>;base64, URLs are taken (the server downloads nothing "
                "and reads no files)",
                param=param,
            )
        try:
            images.append(load_image(url, "."))
        except ImageError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
    return images
