"""Reward shaping and group filtering on the rollout side, after DAPO (Yu et al. 2025, §3.2 and §3.4).

Pure functions of a group's lengths and rewards; :mod:`rollout.loop` applies them before a group is
appended, so the learner never sees the difference between a shaped reward and a plug-in's.

- **Over-long shaping** (DAPO's soft overlong punishment): a response longer than
  ``L_max − L_cache`` loses reward linearly, up to ``penalty`` at ``L_max`` (``rollout.max_new_tokens``),
  so truncated rambling is discouraged without the cliff of a hard penalty.
- **Dynamic sampling**: a group whose rewards are all equal has zero group-normalised advantage for every
  sample (GRPO, RLOO): it costs a learner step's compute and teaches nothing, so it is dropped and
  replaced by a fresh group.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """``−penalty · (length − (max_len − buffer)) / buffer`` inside the last ``buffer`` tokens, else 0.

    ``length`` never exceeds ``max_len`` here: generation stops there (DAPO's ``−1`` beyond it is the
    same as the value at ``max_len`` with ``penalty = 1``).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must be in 1..max_len ({max_len})")
    start = max_len - buffer
    return -penalty * min(max(length - start, 0), buffer) / buffer


def is_informative(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when the group's rewards differ, so group-relative advantages are not all zero."""
    return max(rewards) - min(rewards) > tol
