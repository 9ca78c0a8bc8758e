"""The SFT → reward model → PPO pipeline (docs/stages.md §4): its driver, the preference data it labels
from the SFT policy, and the over-optimisation monitor that watches PPO against a gold scorer.

It sits above the launcher: each stage is an ordinary run (``learner.train``, ``launch.py``) started as a
child process, and the reward model it scores with is the rollout server's.
"""
