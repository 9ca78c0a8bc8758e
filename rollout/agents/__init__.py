"""Black-box agents trained in a run (docs/environments.md §10.9): ``runner.py`` plays each prompt's episodes as
sessions of a user's agent function on an OpenAI-compatible API of its own (a loopback server over the
rollout server's engine), and ``batching.py`` gathers their concurrent calls into engine batches.
"""
