"""Redis clients that ride out a Redis restart (docs/design.md §6.6).

Every process of a run connects through :func:`connect`: a ``redis.Redis`` whose connections retry a
*lost connection* (refused, reset, or ``LOADING`` while the restarted server reads its AOF) with
redis-py's own ``Retry`` and ``ExponentialBackoff``, for about ``reconnect_s`` seconds in all, then raise.
A command that merely times out (a hung server) is not retried: it fails after ``socket_timeout``, so no
wait is unbounded. Lua scripts are re-sent by redis-py after a restart empties the script cache
(``NOSCRIPT``), and a ``PubSub`` re-subscribes when it reconnects.

A command retried after a lost connection may already have run before the crash; every call site is
idempotent or refuses the repeat (docs/design.md §6.6). What a restart *lost* (the last ~second of the
append-only file) is repaired by whoever notices :class:`Incarnation` change: the learner (§6.6).
"""

from __future__ import annotations

import math

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tandem.config import redact

BACKOFF_BASE_S = 0.05  # first retry after 50 ms: a restart on the same machine takes ~0.1-1 s
BACKOFF_CAP_S = 1.0  # then once a second until the budget is spent


def retries_for(budget_s: float, *, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> int:
    """How many retries of ``ExponentialBackoff(cap, base)`` sleep at least ``budget_s`` in total."""
    total, k = 0.0, 0
    while total < budget_s:
        k += 1
        step = min(cap, base * 2**k)
        if step >= cap:  # the rest are all ``cap``
            return k - 1 + math.ceil((budget_s - total) / cap)
        total += step
    return k


def reconnecting(reconnect_s: float) -> Retry:
    """redis-py's retry policy for a lost connection, bounded to about ``reconnect_s`` seconds of waiting."""
    return Retry(
        ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        retries_for(reconnect_s),
        supported_errors=(redis.ConnectionError,),  # BusyLoadingError included; TimeoutError is not
    )


def connect(
    url: str,
    *,
    reconnect_s: float,
    socket_timeout: float = 30.0,
    socket_connect_timeout: float = 10.0,
    **kwargs: object,
) -> redis.Redis:
    """A client of ``url`` that reconnects under bounded retries (nothing is sent until the first command)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        retry=reconnecting(reconnect_s),
        **kwargs,
    )


class RedisUnavailable(ConnectionError):
    """The run's Redis did not answer; ``url`` and ``reason`` have its password redacted."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = redact(url), redact(reason)
        super().__init__(f"Redis at {self.url} does not answer: {self.reason}")


def connect_run(url: str, *, reconnect_s: float, **kwargs: object) -> redis.Redis:
    """:func:`connect`, then one PING (retried as any command is): a client of a Redis that answers now,
    or :class:`RedisUnavailable`, whose message never holds the password."""
    client = connect(url, reconnect_s=reconnect_s, **kwargs)
    try:
        client.ping()
    except redis.RedisError as e:
        client.close()
        raise RedisUnavailable(url, str(e)) from None
    return client


class Incarnation:
    """Tells whether the Redis server behind ``client`` was restarted since the last look.

    Each ``redis-server`` process has a random ``run_id`` (``INFO server``); a new one means a restart,
    which may have lost the writes of its last second (``appendfsync everysec``).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.run_id = self._read()

    def _read(self) -> str:
        return str(self.client.info("server")["run_id"])

    def changed(self) -> bool:
        now = self._read()
        if now == self.run_id:
            return False
        self.run_id = now
        return True
