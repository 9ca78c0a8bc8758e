"""Multi-turn environments (docs/environments.md §10): ``base.py`` is the environment API (Gymnasium's ``Env``
shape, in token space), ``episode.py`` runs many episodes at once through the engine, and
``reasoning_gym.py`` and ``openenv_adapter.py`` bring in reasoning-gym tasks and OpenEnv environments.
"""
