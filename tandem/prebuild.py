"""DeepSpeed's CPU ops: built once at install time, and kept loadable.

``main`` builds them at install time, so the first learner start (and the first test) does not spend a
minute compiling. A no-op where CUDA is present or the build is already cached.

:func:`prepare_extensions` runs before any process loads them. DeepSpeed loads its shared-memory
collective op at every CPU backend start, and torch's loader takes a lock file for the duration; a
process killed at that moment (``kill -9``, a test timeout) leaves the file behind, and every later learner
then waits on it forever. So the build lives in this environment's own directory (not a ``~/.cache``
shared by every checkout), and a lock older than any build could take is removed as stale.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)
STALE_LOCK_S = 600.0  # the slowest build seen here took ~60 s; a lock this old has no live holder


def prepare_extensions(stale_after_s: float = STALE_LOCK_S) -> Path:
    """Point torch's extension builds at this environment and clear stale locks; returns the directory."""
    root = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
    now = time.time()
    for lock in root.glob("*/*/lock") if root.is_dir() else ():
        try:
            age = now - lock.stat().st_mtime
            if age > stale_after_s:
                lock.unlink()
                log.warning("removed a stale build lock %s (%.0f s old; its holder died)", lock, age)
        except FileNotFoundError:  # released meanwhile
            pass
    return root


def main() -> None:
    import torch

    if torch.cuda.is_available():
        return
    prepare_extensions()
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
