"""Build DeepSpeed's CPU ops once at install time, so the first learner start (and the first test) does
not spend a minute compiling them. A no-op where CUDA is present or the build is already cached."""

from __future__ import annotations

import time


def main() -> None:
    import torch

    if torch.cuda.is_available():
        return
    t0 = time.monotonic()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__ as compatible

    for name in ("ShareMemCommBuilder",):  # the learner passes torch.optim.AdamW: no fused-Adam build
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and compatible.get(builder.NAME, False):
            builder.load(verbose=False)
    print(f"[tandem] DeepSpeed CPU ops ready ({time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    main()
