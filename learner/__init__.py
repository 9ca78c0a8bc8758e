"""The learner: the process that trains the actor (and critic), one recipe per run (docs/design.md §1.4, §4).

``train.py`` is the entry point and picks the recipe: ``ppo.py`` (PPO and its GRPO / RLOO / REINFORCE++
variants against the replay buffer), or the offline ``sft.py``, ``rm.py`` and ``dpo.py`` on a fixed dataset.
What recipes share: ``runtime.py`` (ranks, telemetry, stopping), ``online.py`` (buffer, weight sync,
exactly-once commits with ``checkpoint.py``, ``checkpoint_async.py`` and ``acked_ranges.py``),
``offline_runtime.py`` (dataset, evaluation, early stop), ``models.py`` (DeepSpeed engines), ``batch.py``,
``passes.py`` and the pure math of
``advantages.py``, ``losses.py``, ``kl_control.py`` and ``lm_head.py``. It never imports ``rollout``.
"""
