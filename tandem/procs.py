"""Child processes that never outlive their parent: the one place that knows how (Linux prctl).

Every long-lived child we start (the embedded redis-server, rollout servers, the learner, a managed vLLM
or SGLang server) runs in its own session, so a Ctrl-C in the terminal reaches only the parent, which then
stops them in order. Two lines of defence make sure none survives a parent killed by SIGKILL:

1. ``PR_SET_PDEATHSIG``: the kernel SIGTERMs the child when its parent dies. The signal fires when the
   *thread* that forked exits, not the process: a child forked from a short-lived thread would be killed
   when that thread ends. :func:`popen` therefore forks from the main thread or from one long-lived
   spawner thread, whichever thread calls it.
2. The child's own watch (:func:`exit_with_driver`): launch.py puts its pid in ``TANDEM_DRIVER_PID``; a
   learner rank or rollout server polls it, and once the driver is gone (or its own parent changed) it
   SIGTERMs itself (its handler stops cleanly) and exits hard ``ORPHAN_GRACE_S`` seconds later, so a
   graceful stop that blocks (on a Redis that died with the driver) cannot keep it alive. It also covers
   what the death signal misses: torchrun's ranks, whose parent is torchrun, and non-Linux hosts.

A managed engine server (vLLM, SGLang) runs neither watch, and the death signal is not enough for it:
vLLM 0.32 catches SIGTERM while it starts and goes on starting, and its engine core and workers outlive
its API server (both seen on 2026-11-29). So a third line covers engines: the server's process group is
recorded in a file (:func:`record_group`), and :func:`reap_group` kills what is left of it before the
next server of the same name starts, and when launch.py stops the run.

A child that will not stop says why first: on ``STACKS_SIGNAL`` a child of launch.py writes every thread's
stack to its log (``faulthandler``), and the driver sends it before it SIGKILLs a child that outlived its
grace (launcher/backends/local.py), so a hang at shutdown leaves the place it hung in the log.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen after fork
except OSError:  # not Linux: sessions, explicit stops and the driver watch still apply
    _libc = None

DRIVER_PID_ENV = "TANDEM_DRIVER_PID"
ORPHAN_GRACE_S = 3.0  # after the driver died: time for a clean stop before a hard exit
STACKS_SIGNAL = signal.SIGUSR1  # a child of launch.py writes its threads' stacks to its log
STACKS_WAIT_S = 1.0  # for a child's stacks to reach its log before it is killed
WATCH_POLL_S = 0.5


def exit_now(code: int) -> NoReturn:
    """End a finished process (launch.py, a learner rank, a rollout server) with ``code`` as a normal exit
    would, less the interpreter's teardown: other threads are joined and the ``atexit`` handlers run (a
    managed engine server is stopped, logs flushed), then the process exits without freeing torch and
    transformers module by module, which took a second or more per process on 2 cores, on the critical path
    of every run's stop."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # the interpreter's own exit step (logging.shutdown is one of them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: runs between fork and exec, so only an async-signal-safe call."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# Keyword arguments for subprocess.Popen giving both properties.
DETACHED = {"start_new_session": True, "preexec_fn": die_with_parent}

_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(cmd, **DETACHED, **kwargs)``, forked from a thread that lives as long as this
    process (the main thread, or one spawner thread), so the child's death signal means the process died."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(cmd, **DETACHED, **kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawner")
    return _spawner.submit(lambda: subprocess.Popen(cmd, **DETACHED, **kwargs)).result()


def _stat_fields(pid: int | str) -> list[bytes]:
    """``/proc/PID/stat`` from field 3 (the state) on: what follows the command name, which may hold spaces
    and parentheses of its own. Raises OSError where there is no such process (or no /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); ``None`` if it is gone."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def record_group(path: Path, pid: int) -> None:
    """Write down the process group ``pid`` leads on this host, for :func:`reap_group`."""
    path.write_text(f"{pid} {start_time(pid)} {socket.gethostname()}\n")


def reap_group(path: Path) -> list[int]:
    """SIGKILL what is left of the process group recorded in ``path`` and remove the file; returns the pids
    killed. Linux gives no new process a pid still in use as a group id, so the group's survivors are the
    processes with that group id, unless its leader lives on and is another process (its start differs).
    A group of another host (a run directory on a shared filesystem) is left alone."""
    try:
        pgid_text, started, host = path.read_text().split()
        pgid = int(pgid_text)
    except (OSError, ValueError):
        return []
    if host != socket.gethostname():
        return []
    path.unlink(missing_ok=True)
    leader = start_time(pgid)
    if leader is not None and str(leader) != started:
        return []
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_stat_fields(pid)[2]) == pgid:  # field 5, the process group
                members.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return members


def driver_env() -> dict[str, str]:
    """What launch.py adds to its children's environment so that they watch it (:func:`exit_with_driver`)."""
    return {DRIVER_PID_ENV: str(os.getpid())}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return _stat_fields(pid)[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def exit_with_driver(grace_s: float = ORPHAN_GRACE_S) -> threading.Thread | None:
    """In a child of launch.py: a daemon thread that ends this process soon after the driver is gone, and
    every thread's stack written to stderr (the child's log) on ``STACKS_SIGNAL``. Nothing (None) outside
    launch.py, where ``TANDEM_DRIVER_PID`` is unset."""
    raw = os.environ.get(DRIVER_PID_ENV)
    if not raw or not raw.isdigit() or int(raw) == os.getpid():
        return None
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    thread = threading.Thread(
        target=_watch, args=(int(raw), os.getppid(), grace_s), name="driver-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(driver: int, parent: int, grace_s: float) -> None:
    while alive(driver) and os.getppid() == parent:
        time.sleep(WATCH_POLL_S)
    print(
        f"launch.py (pid {driver}) is gone: stopping, and exiting within {grace_s:g}s",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)  # a clean stop where the process has a handler for it
    time.sleep(grace_s)
    os._exit(1)  # the clean stop blocked (e.g. on the Redis that died with the driver)
