"""The rollout side: long-lived servers that turn prompts into scored trajectories (docs/design.md §1.3).

``server.py`` is a server process (connected to a run, or a standalone OpenAI-compatible server);
``loop.py`` its rollout loop (admit, claim prompts, generate, score, append), with ``scoring.py``,
``shaping.py``, ``reward_model.py`` and ``reference.py`` scoring groups, ``weights.py`` applying weight
updates and ``evaluate.py`` the held-out evaluation. ``own_scorer.py`` scores the stream on a worker of its
own (a model placed ``own``). The subpackages hold the inference engines (``engines/``), the HTTP API
(``http/``), multi-turn environments (``envs/``) and black-box agents (``agents/``). It never imports
``learner``.
"""
