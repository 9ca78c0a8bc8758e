"""Images for vision-language prompts: reading a record's ``images``, and a checkpoint's processor.

A prompt record may carry ``images``: paths relative to the prompt file, or inline
``data:image/...;base64,`` strings. Remote URLs are refused (tandem downloads nothing). :func:`load_image`
is the one reader, used to check a dataset up front and to feed the processor.

:class:`VisionProcessor` does what a Qwen2-VL processor does for images, from the checkpoint's tokenizer
and image processor: render the chat template with an image part per image, expand each image
placeholder to as many tokens as the image has merged patches, and return the token ids with the pixel
values and grid sizes (:class:`VisionInputs`) the model needs beside them. It loads with
``AutoTokenizer`` and ``AutoImageProcessor`` rather than ``AutoProcessor``: transformers' Qwen-VL
processors also build a video processor, which needs torchvision, and this project's environments have
none. The token ids it makes are the ones the processor would make.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image

IMAGE_PART = {"type": "image"}


class ImageError(ValueError):
    """An image entry that cannot be used, saying which and why."""


def load_image(entry: str, base: str | Path) -> Image.Image:
    """The image an ``images`` entry names, decoded and in RGB: a ``data:image/...;base64,`` string or a path
    relative to ``base`` (the prompt file's folder). ImageError for a remote URL, a missing file or bytes
    that are not an image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(entry, str) or not entry:
        raise ImageError("an image entry must be a non-empty string (a path or a data: URL)")
    low = entry[:8].lower()
    if low.startswith(("http://", "https://")):
        raise ImageError(
            f"{_short(entry)}: remote image URLs are refused (nothing is downloaded); "
            "save the image beside the prompt file and give its path"
        )
    if low.startswith("data:"):
        head, sep, payload = entry.partition(",")
        if not sep or not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
            raise ImageError(f"{_short(entry)}: a data URL must be data:image/<type>;base64,<data>")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{_short(entry)}: the base64 data does not decode") from None
        source: Any = io.BytesIO(raw)
        name = _short(entry)
    else:
        path = Path(base) / entry
        if not path.is_file():
            raise ImageError(f"image {entry!r}: no such file ({path})")
        source, name = path, repr(entry)
    try:
        with Image.open(source) as img:
            img.load()  # decode now: a truncated file fails here, not in a rollout server
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"image {name}: not a readable image ({e})") from None


def images_problem(value: Any, base: str | Path) -> str | None:
    """Why a record's ``images`` value cannot be used (naming the entry), or None: a list of entries that
    :func:`load_image` reads."""
    if not isinstance(value, list) or not value:
        return "field 'images' must be a non-empty list of paths or data: URLs"
    for i, entry in enumerate(value):
        try:
            load_image(entry, base)
        except ImageError as e:
            return f"field 'images' entry {i}: {e}"
    return None


def _short(entry: str) -> str:
    return repr(entry if len(entry) <= 40 else entry[:37] + "...")


def is_vision_checkpoint(path: str | Path) -> bool:
    """True when a checkpoint's config.json has a vision tower (``vision_config``)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


@dataclass
class VisionInputs:
    """What a Qwen2-VL forward needs beside the token ids for one prompt's (or several's) images.

    Shapes: pixel_values (patches, channels x temporal x patch x patch) float32, image_grid_thw (images, 3)
    int64: each image's (temporal, height, width) in patches.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def to(self, device: torch.device | str) -> VisionInputs:
        return VisionInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))

    @staticmethod
    def concat(parts: list[VisionInputs]) -> VisionInputs:
        """Several rows' inputs as one, in row order (the model matches images to placeholders in order)."""
        import torch

        return VisionInputs(
            torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts])
        )

    @staticmethod
    def of(trajectory: Any) -> VisionInputs | None:
        """A trajectory's images (``pixel_values``, ``image_grid_thw``; buffer/schema.py), None without."""
        import torch

        if trajectory.pixel_values is None:
            return None
        return VisionInputs(
            torch.from_numpy(trajectory.pixel_values), torch.from_numpy(trajectory.image_grid_thw).long()
        )

    def arrays(self) -> dict[str, Any]:
        """As a trajectory's fields: ``pixel_values`` float32 (patches, dim), ``image_grid_thw`` int32."""
        return {
            "pixel_values": self.pixel_values.detach().cpu().float().numpy(),
            "image_grid_thw": self.image_grid_thw.detach().cpu().int().numpy(),
        }

    def placeholders(self, merge_size: int) -> int:
        """Image placeholder tokens these images fill in the token ids."""
        return int((self.image_grid_thw.prod(-1) // merge_size**2).sum())


class VisionProcessor:
    """A checkpoint's tokenizer and image processor, turning a prompt and its images into model inputs."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.image_token: str = tokenizer.convert_ids_to_tokens(image_token_id)
        self.merge_size: int = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path, *, trust_remote_code: bool = False) -> VisionProcessor:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(
            AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
            AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code),
            int(config.image_token_id),
        )

    def pixels(self, images: list[Image.Image]) -> VisionInputs:
        out = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(out["pixel_values"].float(), out["image_grid_thw"].long())

    def encode(
        self, text: str, images: list[Image.Image], *, chat_template: bool = True
    ) -> tuple[list[int], VisionInputs]:
        """Token ids of a user turn holding ``images`` then ``text`` (its placeholders expanded), and the
        images' pixel values. Without ``chat_template`` the text must hold one placeholder per image."""
        if chat_template:
            content = [IMAGE_PART] * len(images) + [{"type": "text", "text": text}]
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        else:
            rendered = text
        return self.expand(rendered, images)

    def expand(self, rendered: str, images: list[Image.Image]) -> tuple[list[int], VisionInputs]:
        """Token ids of ``rendered`` text holding one placeholder per image, each expanded to the tokens its
        image fills, and the images' pixel values."""
        vision = self.pixels(images)
        pieces = rendered.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images")
        counts = (vision.image_grid_thw.prod(-1) // self.merge_size**2).tolist()
        expanded = pieces[0] + "".join(
            self.image_token * int(c) + rest for c, rest in zip(counts, pieces[1:], strict=True)
        )
        return [int(t) for t in self.tokenizer(expanded)["input_ids"]], vision


def pixel_bytes(trajectories: Any) -> int:
    """Bytes of image inputs the trajectories carry on the wire: each sample holds its own copy of its
    prompt's pixels, so a group of n carries n (``rollout/pixel_bytes_per_group``)."""
    return sum(
        t.pixel_values.nbytes + t.image_grid_thw.nbytes for t in trajectories if t.pixel_values is not None
    )


# The logit a vision-language policy gives its image placeholder tokens, in the engine and the learner
# alike: a placeholder is where the processor puts an image, never text the model writes (one in a response
# would be matched to image features in the learner's forward and fail it). Finite, not -inf, so that
# entropies and the chunked head's gradients stay finite (0 · -1e9 is 0; 0 · -inf is NaN); exp of it is 0.
SUPPRESSED_LOGIT = -1e9


def placeholder_ids(config: Any) -> list[int]:
    """A vision-language model config's image and video placeholder token ids (empty for a text model)."""
    ids = [getattr(config, k, None) for k in ("image_token_id", "video_token_id")]
    return [int(i) for i in ids if isinstance(i, int)] if hasattr(config, "vision_config") else []


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """1 at image placeholder tokens, 0 elsewhere: what Qwen2-VL's 3-D positions are computed from."""
    return (input_ids == image_token_id).int()
