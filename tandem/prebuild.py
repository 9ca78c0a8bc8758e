"""DeepSpeed's CPU ops: built once at install time, and loaded so that a killed loader never blocks the next.

``main`` builds them at install time, so the first learner start (and the first test) does not spend a
minute compiling. A no-op where CUDA is present or the build is already cached.

:func:`prepare_extensions` loads them before DeepSpeed asks for them. torch's extension loader guards every
load, cached or not, with a lock *file* (``<op>/lock``) that it deletes when done; a process killed while
holding it (``kill -9``, which the chaos test does to learners as they start) leaves the file behind, and
every later loader waits on it forever. So tandem's loads take a kernel lock first (``flock``, released
when its holder dies, however it dies): holding it, any torch lock file left in the directory belongs to a
dead process and is removed. DeepSpeed then finds the op already loaded in this process. The build lives
in this environment's own directory, not a ``~/.cache`` shared with other checkouts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tandem.timing import timed

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 900.0  # another process's first build takes ~60 s here, far longer on a loaded machine
CPU_OPS = ("ShareMemCommBuilder",)  # the learner passes torch.optim.AdamW: no fused-Adam build


class ExtensionLockTimeout(TimeoutError):
    """Another live process held the extension lock for longer than the wait allows."""


def extensions_dir() -> Path:
    return Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))


@contextlib.contextmanager
def load_lock(root: Path, timeout_s: float = LOAD_TIMEOUT_S) -> Iterator[None]:
    """Hold the directory's kernel lock; inside it, torch's lock files are all left by dead processes."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "tandem-load.lock", "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ExtensionLockTimeout(
                        f"{root}: another process has been building or loading DeepSpeed's CPU ops for "
                        f"over {timeout_s:.0f} s; see `lsof {root / 'tandem-load.lock'}`"
                    ) from None
                time.sleep(0.2)
        try:
            # <dir>/<op>/lock under TORCH_EXTENSIONS_DIR (ours), <dir>/<py_cu>/<op>/lock under torch's default
            for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                    log.warning("removed %s, left by a process killed while it loaded the op", lock)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_cpu_ops() -> None:
    """Build (once) and load DeepSpeed's CPU ops into this process; later ``load()`` calls hit its cache."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__ as compatible

    for name in CPU_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and compatible.get(builder.NAME, False):
            builder.load(verbose=False)


def prepare_extensions(load: bool = True, timeout_s: float = LOAD_TIMEOUT_S) -> Path:
    """Point torch's extension builds at this environment and load the CPU ops under the kernel lock."""
    root = extensions_dir()
    with load_lock(root, timeout_s):
        if load:
            load_cpu_ops()
    return root


def main() -> None:
    import torch

    if torch.cuda.is_available():
        return
    with timed() as span:
        prepare_extensions()
    print(f"[tandem] DeepSpeed CPU ops ready ({span.seconds:.0f}s)")


if __name__ == "__main__":
    main()
