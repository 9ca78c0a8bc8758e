"""Child processes that never outlive their parent: the one place that knows how (Linux prctl).

Every long-lived child we start (the embedded redis-server, rollout servers, the learner, a managed vLLM
or SGLang server) runs in its own session, so a Ctrl-C in the terminal reaches only the parent, which then
stops them in order; and each gets ``PR_SET_PDEATHSIG`` so that it is SIGTERMed even if the parent dies
by SIGKILL. The signal fires when the *thread* that forked exits: start children from a long-lived thread.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen after fork
except OSError:  # not Linux: sessions and explicit stops still apply
    _libc = None


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: runs between fork and exec, so only an async-signal-safe call."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# Keyword arguments for subprocess.Popen giving both properties.
DETACHED = {"start_new_session": True, "preexec_fn": die_with_parent}
