"""Black-box agent sessions: OpenAI-API calls captured as one training trajectory, token-exact (docs/environments.md §10.6).

An agent written against the OpenAI client marks its calls with a session id (the ``X-Session-Id`` header,
or ``session_id`` in the body via the client's ``extra_body``). For such a call the server does not
tokenise the agent's prompt text as it is: it keeps the session's token sequence, the first prompt plus
every sampled token exactly as the engine produced it, and tokenises only the text the agent *added*
since its last call (a tool result, a user turn), appended with ``loss_mask`` 0. The model therefore sees,
and the learner trains on, the very tokens that were sampled, with their behaviour logprobs and versions
(AReaL's online proxy; Miles' token-in-token-out). A chat request's messages are rendered through the chat
template to text first, and then handled the same way.

The added text is found as the suffix after the session's transcript: the last prompt text plus the
completion, either as returned (cut before a stop string) or in full (:func:`continuation`). A prompt that
does not extend the transcript *rewrites history*: a thinking model's chat template drops earlier turns'
``<think>...</think>`` when it renders them again (Qwen3), so the agent's next prompt no longer starts with
what the model sampled. ``on_rewrite`` says what then happens (``rollout.http.session.on_rewrite``):
``split`` (the default) starts a new *segment* of the same session, from that prompt tokenised as it is;
``refuse`` answers 400, as an edit of history is refused rather than silently re-tokenised. A session is
thus a list of segments, each a token-exact trajectory of its own (its prompt, then the added text with
``loss_mask`` 0 and the sampled tokens with ``loss_mask`` 1). ``finish(session, reward)`` closes the
session into one :class:`buffer.schema.Trajectory` per segment, each with the session's reward.

A completion returned as tool calls (docs/environments.md §10.8) is remembered by its call ids: when the agent
sends that assistant message back, it is rendered as the text the model sampled, so the next prompt still
extends the transcript.

A call changes the session only once its completion is recorded: a call that fails or is cancelled leaves
no trace, so the agent may retry it. Session ids are the server's: ``POST /v1/sessions`` opens one and
returns its id (unguessable), and a call or finish naming an id the server did not issue, or has closed,
is refused; a client cannot choose an id, nor reach another client's session by guessing one. An agent run
in the rollout loop (docs/environments.md §10.9) uses a ``strict`` store: sessions are opened and closed by the
runner only, and a completion that arrives after its session was closed is dropped.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from transformers import PreTrainedTokenizerBase

from buffer.schema import Trajectory, Turns
from rollout.engines.base import Completion

MAX_SESSIONS = 4096  # open sessions per server; the oldest idle one is dropped past this


class SessionError(ValueError):
    """A session call that cannot be served; the message says why."""


def segment_meta(index: int, segments: int) -> dict[str, int]:
    """A segment trajectory's place in its episode (``meta``): the learner counts an episode once in its
    group's statistics however many segments it has (docs/environments.md §10.6)."""
    return {"segment": index, "segments": segments}


@dataclass(frozen=True)
class _Plan:
    """A call's place in its session: the segment's prompt, the tokens the call adds after the segment's
    tokens, and the context generated from."""

    prompt: list[int]
    added: list[int]
    context: list[int]
    new_segment: bool


OnRewrite = Literal["split", "refuse"]


def continuation(transcripts: Sequence[str], prompt_text: str) -> str | None:
    """The text a call's prompt adds to its session's transcript (any of ``transcripts``, longest first),
    or None when the prompt does not extend it: the history was rewritten, and the call starts a new
    segment (or is refused)."""
    return next((prompt_text[len(t) :] for t in transcripts if prompt_text.startswith(t)), None)


@dataclass
class Segment:
    """One token-exact trajectory of a session: its prompt, then its turns (added text and completions)."""

    prompt: list[int]
    turns: Turns
    calls: int


@dataclass
class Session(Turns):
    """An open session; its own fields are the current segment's, ``earlier`` holds the ones before."""

    session_id: str
    prompt: list[int] = field(default_factory=list)
    transcripts: tuple[str, ...] = ()  # what the agent's next prompt may start with, longest first
    calls: int = 0  # in all segments
    segment_calls: int = 0  # in the current one
    earlier: list[Segment] = field(default_factory=list)  # segments closed by a rewrite of history
    tool_call_turns: int = 0  # completions returned as tool calls (docs/environments.md §10.8)
    tool_turns: dict[str, str] = field(default_factory=dict)  # tool call id -> the completion's text
    touched: float = field(default_factory=time.monotonic)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def rewrites(self) -> int:
        """Calls whose prompt did not extend the transcript, each of which started a segment."""
        return len(self.earlier)

    def segments(self) -> list[Segment]:
        """Every segment with a completion, in order."""
        return [*self.earlier, self._current()] if self.segment_calls else list(self.earlier)

    def start_segment(self, prompt: list[int]) -> None:
        """Close the current segment (it has a completion) and start one from ``prompt``."""
        self.earlier.append(self._current())
        self.prompt, self.segment_calls = prompt, 0
        self.tokens, self.logp, self.versions, self.mask = [], [], [], []

    def _current(self) -> Segment:
        turns = Turns(tokens=self.tokens, logp=self.logp, versions=self.versions, mask=self.mask)
        return Segment(self.prompt, turns, self.segment_calls)


class SessionStore:
    """Open sessions of one server, safe across the API's worker threads. Only sessions opened with
    :meth:`issue` (the API's ``POST /v1/sessions``) or :meth:`open` take calls. ``strict``: the owner
    (an agent runner) opens them all, and :meth:`issue` is refused."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, strict: bool = False, on_rewrite: OnRewrite = "split"
    ) -> None:
        self.tokenizer, self.strict, self.on_rewrite = tokenizer, strict, on_rewrite
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str) -> None:
        with self._lock:
            if len(self.sessions) >= MAX_SESSIONS:  # past the limit, the oldest idle one goes
                oldest = min(self.sessions.values(), key=lambda x: x.touched)
                del self.sessions[oldest.session_id]
            self.sessions[session_id] = Session(session_id)

    def issue(self) -> str:
        """Open a session under a fresh id of the server's, and return the id."""
        if self.strict:
            raise SessionError("sessions on this server are opened by its agent runner")
        session_id = f"sess-{secrets.token_hex(16)}"
        self.open(session_id)
        return session_id

    def close(self, session_id: str) -> Session | None:
        """Take a session out of the store: later calls on it are refused, late completions dropped."""
        with self._lock:
            return self.sessions.pop(session_id, None)

    def context(self, session_id: str, prompt_text: str) -> list[int]:
        """The token ids to generate from: the session's exact tokens plus the agent's new text."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise SessionError(
                    f"session {session_id!r} is not open on this server: POST /v1/sessions opens one and "
                    "returns its id"
                )
            s.touched = time.monotonic()
            return self._plan(s, prompt_text).context

    def record(
        self,
        session_id: str,
        prompt_text: str,
        c: Completion,
        returned_text: str,
        *,
        context: list[int] | None = None,
    ) -> None:
        """Append the call's new text (loss_mask 0) and its completion's sampled tokens (loss_mask 1), in a
        new segment when the prompt rewrote the history. ``context``: the tokens the completion was
        generated from (:meth:`context`); when another call was recorded meanwhile and the session would
        now give other tokens, this completion is dropped (the other one is kept)."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:  # closed while the call ran: the episode is over without it
                return
            try:
                plan = self._plan(s, prompt_text)
            except SessionError:  # another call on the session was recorded meanwhile: keep that one
                return
            if context is not None and plan.context != context:
                return
            if plan.new_segment:
                s.start_segment(plan.prompt)
            s.prompt = plan.prompt
            s.add(plan.added, [], [], generated=False)
            s.add(c.token_ids, c.logprobs, c.versions, generated=True)
            full = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            s.transcripts = tuple(
                sorted({prompt_text + full, prompt_text + returned_text}, key=len, reverse=True)
            )
            s.calls += 1
            s.segment_calls += 1

    def _plan(self, s: Session, prompt_text: str) -> _Plan:
        """Where a call's prompt goes: after the session's tokens, or (a first call, or a rewrite under
        ``split``) at the start of a segment of its own."""
        added = continuation(s.transcripts, prompt_text) if s.calls else None
        if added is not None:
            tokens = self.encode(added)
            return _Plan(s.prompt, tokens, s.prompt + s.tokens + tokens, new_segment=False)
        if s.calls and self.on_rewrite == "refuse":
            raise SessionError(
                f"session {s.session_id!r}: the prompt does not extend the session's transcript (the last "
                "prompt and its completion); start a new session instead of editing history, or set "
                "rollout.http.session.on_rewrite=split to train it as a new segment"
            )
        prompt = self.encode(prompt_text)
        if not prompt:
            raise SessionError("the session's prompt is empty")
        return _Plan(prompt, [], prompt, new_segment=bool(s.calls))

    def remember_tool_turn(self, session_id: str, call_ids: list[str], text: str) -> None:
        """The completion's text (as returned) stands for its tool calls ``call_ids`` from now on."""
        with self._lock:
            if (s := self.sessions.get(session_id)) is not None:
                s.tool_turns.update(dict.fromkeys(call_ids, text))
                s.tool_call_turns += 1

    def tool_turns(self, session_id: str) -> dict[str, str]:
        """Tool call id -> the text of the completion that made the call, for an open session."""
        with self._lock:
            s = self.sessions.get(session_id)
            return dict(s.tool_turns) if s is not None else {}

    def finish(self, session_id: str, reward: float, group_id: str | None = None) -> list[Trajectory]:
        """Close a session into its segments' trajectories, each with ``reward``, in one group."""
        with self._lock:
            s = self.sessions.pop(session_id, None)
        if s is None or not s.calls:
            raise SessionError(f"session {session_id!r}: no such open session with a completion")
        segments = s.segments()
        return [
            x.turns.as_trajectory(
                x.prompt,
                prompt_id=session_id,
                group_id=group_id or session_id,
                reward=reward,
                reward_parts={"agent": reward},
                meta={
                    "session_id": session_id,
                    "calls": x.calls,
                    "version": min(x.turns.generated_versions()),
                    **segment_meta(k, len(segments)),
                },
            )
            for k, x in enumerate(segments)
        ]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
