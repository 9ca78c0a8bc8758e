"""The rollout server's OpenAI-compatible HTTP API (FastAPI + uvicorn in a thread of the server process).

:mod:`rollout.http.app` (the app, its routes and the :class:`~rollout.http.app.API` serving them),
:mod:`rollout.http.inputs` (a request's prompts and sampling parameters, checked against the limits),
:mod:`rollout.http.choices` (completions as OpenAI's choices), :mod:`rollout.http.streaming` (streamed
chunks as server-sent events), :mod:`rollout.http.disconnect` (a client gone cancels its generation),
:mod:`rollout.http.schemas` (request schemas, text validation, the error shape),
:mod:`rollout.http.images` (``image_url`` parts for a vision-language model, docs/design.md §8.4),
:mod:`rollout.http.middleware` (body limit, bearer token, request count), :mod:`rollout.http.sessions`
(black-box agent sessions, docs/environments.md §10.6) and :mod:`rollout.http.session_api` (their routes
and calls), :mod:`rollout.http.chat_prompt` (chat messages and tools through the chat template),
:mod:`rollout.http.parsers` (reasoning and tool calls read from a completion's text, docs/environments.md
§10.8), :mod:`rollout.http.tools` (the Hermes-style prompt for templates without tools) and
:mod:`rollout.http.serve` (the uvicorn thread); Anthropic's Messages API and OpenAI's Responses API as
translations onto the chat path, :mod:`rollout.http.messages_api` and :mod:`rollout.http.responses_api`
over :mod:`rollout.http.surface` (docs/environments.md §10.10).
"""
