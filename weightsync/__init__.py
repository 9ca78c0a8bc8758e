"""Versioned actor-weight broadcast from the learner to every rollout server."""

from weightsync.base import Publisher, Subscriber, TensorMeta, Update, WeightSyncError

__all__ = ["Publisher", "Subscriber", "TensorMeta", "Update", "WeightSyncError"]
