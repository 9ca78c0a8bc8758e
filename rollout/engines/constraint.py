"""Constrained decoding: what a request's completion must match, and the hf engine's token masks for it.

JSON is compact (no free whitespace: ``{"a": 1, "b": 2}``), on every engine. A :class:`Constraint` is
engine-neutral data on :class:`rollout.engines.base.SamplingParams`: a JSON schema
(``response_format``) or an xgrammar structural tag (forced tool calls, built by
:func:`rollout.http.constraints.constraint_for`). vLLM and SGLang receive it as their own structured-output
parameters; the hf engine compiles it here with xgrammar, the library vLLM and SGLang use by default.

Per row, a ``GrammarMatcher`` says which tokens may come next: before sampling, the row's logits outside
that set become ``-inf`` (xgrammar's bitmask); the sampled token then advances the matcher. Rows without a
constraint are left untouched, so they sample exactly as they would alone.

Which log-probability a constrained token carries (docs/design.md §8.2): the masked distribution's, as for
top-k and top-p. The token was drawn from ``μ(a) = π(a) · 1[a allowed] / Z``, not from ``π``; reporting
``log μ`` makes the learner's importance weight ``π_θ / μ`` honest (it is ``Z ≤ 1`` at the sampling
weights, smaller the more mass the policy put on tokens the grammar forbade), where ``log π`` would claim
the sample was on-policy. vLLM does the same: its grammar bitmask is applied to the logits before the
sampler computes any logprob, raw or processed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

ConstraintKind = Literal["json_schema", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """What a completion must match. ``spec``: JSON text of a JSON schema (``json_schema``) or of an
    xgrammar structural tag (``structural_tag``, ``{"type": "structural_tag", "format": ...}``)."""

    kind: ConstraintKind
    spec: str

    def grammar(self) -> xgr.Grammar:
        """The xgrammar grammar (no tokenizer needed); raises ``ValueError`` saying why it is invalid."""
        try:
            if self.kind == "json_schema":
                return xgr.Grammar.from_json_schema(self.spec, any_whitespace=False)
            return xgr.Grammar.from_structural_tag(self.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(str(e).strip() or type(e).__name__) from None


def json_schema_constraint(schema: dict[str, object]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


class Grammars:
    """The hf engine's xgrammar state: the tokenizer's vocabulary as xgrammar sees it and a compiler whose
    cache keeps each distinct constraint compiled once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: set[int]) -> None:
        # vocab_size: the model's logits width, which may exceed the tokenizer's (padded head rows).
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info)
        self._lock = threading.Lock()  # compiling from several calls' threads at once

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        with self._lock:
            if constraint.kind == "json_schema":
                return self.compiler.compile_json_schema(constraint.spec, any_whitespace=False)
            return self.compiler.compile_structural_tag(constraint.spec)

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """``logits`` (B, V) with each constrained row's forbidden tokens at ``-inf``; other rows untouched.

        A row whose matcher allows nothing (it has ended) keeps only its stop tokens, which xgrammar's
        mask already holds once the grammar may end."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
        logits = logits.float().clone()  # the caller's logits stay the model's
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return logits


def advance(matcher: xgr.GrammarMatcher, token: int) -> None:
    """Feed the sampled token to the row's matcher; a token it refuses means the mask was not applied."""
    if not matcher.is_terminated() and not matcher.accept_token(token):
        raise RuntimeError(f"token {token} does not follow the request's grammar")
