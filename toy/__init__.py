"""The demo kit: what the shipped tiny configs train on, on 2 CPU cores.

``toy.tiny`` builds tiny random-weight Hugging Face checkpoints (a character or byte-level tokenizer, chat
templates); ``toy.tasks`` holds the toy tasks (prompts, rewards, demonstrations, preference pairs);
``toy.calculator`` is a tool-use environment (a ``rollout.envs.base.Env``); ``toy.warmstart`` runs the
learner's ``sft`` recipe on a task's demonstrations. ``python -m toy`` makes each of them from the command
line (``make-tiny``, ``make-data``, ``warmstart``). It sits beside the launcher, above rollout and the learner
(docs/design.md §1.9); configs name its functions by dotted path (``toy.tasks.echo:reward``).
"""
