"""Whether two checkpoints share one tokenizer: a distillation teacher scores the student's token ids, so
its vocabulary and special tokens must be the student's own (``algorithm.distill``, docs/design.md §4.10).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.config import ConfigError


def tokenizer_mismatch(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> str | None:
    """What differs between two tokenizers, or None when they map every token the same way: the same
    vocabulary (token -> id, added tokens included) and the same special tokens with the same ids."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        moved = sorted(t for t in a.keys() & b.keys() if a[t] != b[t])
        parts = [f"vocabulary sizes {len(a)} and {len(b)}"]
        if only_a or only_b:
            parts.append(f"tokens only in the student {only_a[:5]}, only in the teacher {only_b[:5]}")
        if moved:
            parts.append(f"tokens with other ids {[(t, a[t], b[t]) for t in moved[:5]]}")
        return "; ".join(parts)
    specials_a, specials_b = _specials(student), _specials(teacher)
    if specials_a != specials_b:
        differ = sorted(
            k for k in specials_a.keys() | specials_b.keys() if specials_a.get(k) != specials_b.get(k)
        )
        return "special tokens differ: " + ", ".join(
            f"{k} {specials_a.get(k)!r} vs {specials_b.get(k)!r}" for k in differ
        )
    return None


def _specials(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Each special-token role (bos, eos, pad, ...) with its token and id."""
    return {role: (token, tok.convert_tokens_to_ids(token)) for role, token in tok.special_tokens_map.items()}


def check_same_tokenizer(student_path: str, teacher_path: str, *, trust_remote_code: bool = False) -> None:
    """Raise :class:`ConfigError` naming both checkpoints when their tokenizers differ (see
    :func:`tokenizer_mismatch`)."""
    load = AutoTokenizer.from_pretrained
    student = load(student_path, trust_remote_code=trust_remote_code)
    teacher = load(teacher_path, trust_remote_code=trust_remote_code)
    problem = tokenizer_mismatch(student, teacher)
    if problem is not None:
        raise ConfigError(
            f"model.teacher: the tokenizer of {teacher_path} is not that of model.actor {student_path} "
            f"({problem}); on-policy distillation scores the student's token ids under the teacher, so "
            "both must share one tokenizer"
        )
