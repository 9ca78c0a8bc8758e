"""The replay buffer: Redis Streams carrying prompts to rollout servers and trajectories to the learner.

- :mod:`buffer.schema`: the wire records (Trajectory, PromptRecord) and their one codec;
- :mod:`buffer.streams`: :class:`ReplayBuffer`, the two streams (put/take/ack trajectories, prompts, metrics);
- :mod:`buffer.group_stream`: :class:`GroupStream`, one stream through a consumer group (at-least-once
  delivery, capacity, claims); :mod:`buffer.dead_letters`: where the entries it refuses go;
- :mod:`buffer.admission`: :class:`Admission` (the policy version, admission, credits, staleness rules);
- :mod:`buffer.redis_server`: the embedded redis-server (loopback, password, AOF).
"""

from buffer.admission import Admission
from buffer.redis_server import EmbeddedRedis, RedisBinaryNotFound
from buffer.schema import PromptRecord, SchemaError, Trajectory
from buffer.streams import ReplayBuffer, Taken, TakenPrompt

__all__ = [
    "Admission",
    "EmbeddedRedis",
    "PromptRecord",
    "RedisBinaryNotFound",
    "ReplayBuffer",
    "SchemaError",
    "Taken",
    "TakenPrompt",
    "Trajectory",
]
