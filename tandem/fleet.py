"""The rollout fleet: which servers are connected to a run now, and which ever were (docs/design.md §1.8).

Each connected rollout server beats ``{run}:fleet`` (a sorted set: member = its name, score = Redis' own
clock in ms, so hosts need not agree on the time) every ``BEAT_S`` from a daemon thread, and removes
itself when it stops cleanly. A server is in the fleet while its last beat is younger than ``LIVE_S``, so
one killed with SIGKILL leaves it within ``LIVE_S``. ``{run}:fleet:seen`` keeps every name that ever
joined (the summary collects their histories); ``{run}:fleet:next_id`` hands out server ids to joiners
(``launch.py --attach``), never reusing one, so consumer names, seeds and ports stay distinct.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import redis

log = logging.getLogger(__name__)

BEAT_S = 1.0
LIVE_S = 10.0  # generous: a loaded host may delay a beat by seconds


def fleet_key(run: str, *parts: str) -> str:
    return ":".join([run, "fleet", *parts])


def _now_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def beat(client: redis.Redis, run: str, name: str) -> None:
    now = _now_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(fleet_key(run), {name: now})
    pipe.sadd(fleet_key(run, "seen"), name)
    pipe.execute()


def leave(client: redis.Redis, run: str, name: str) -> None:
    client.zrem(fleet_key(run), name)


def members(client: redis.Redis, run: str) -> list[str]:
    """Servers whose last beat is younger than LIVE_S, sorted by name."""
    since = _now_ms(client) - int(LIVE_S * 1000)
    return sorted(m.decode() for m in client.zrangebyscore(fleet_key(run), since, "+inf"))


def seen(client: redis.Redis, run: str) -> list[str]:
    return sorted(m.decode() for m in client.smembers(fleet_key(run, "seen")))


def allocate_ids(client: redis.Redis, run: str, count: int, *, first: int) -> list[int]:
    """``count`` server ids never handed out before in this run; ids below ``first`` are launch.py's."""
    key = fleet_key(run, "next_id")
    client.set(key, first, nx=True)
    end = int(client.incrby(key, count))
    return list(range(end - count, end))


class Beat:
    """A daemon thread beating for ``name`` until ``stop()``, which takes it out of the fleet."""

    def __init__(self, client: redis.Redis, run: str, name: str) -> None:
        self.client, self.run, self.name = client, run, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-beat", daemon=True)

    def start(self) -> Beat:
        beat(self.client, self.run, self.name)  # in the fleet from the moment it is ready
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            leave(self.client, self.run, self.name)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                beat(self.client, self.run, self.name)
            except redis.RedisError as e:  # a missed beat only shows in the fleet count
                log.warning("%s: fleet heartbeat failed: %s", self.name, e)
