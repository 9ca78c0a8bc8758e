"""The config reference: every field's dotted path, default and description, read from the section
models (``python -m tandem config-doc`` prints them; the README's table is generated from them).
"""

from __future__ import annotations

from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from tandem.config.base import Section
from tandem.config.root import Config


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, default, description) for every field; the README's config table is generated from this. A
    list of sections is a row of its own, then its items' fields as ``path[].field``."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"  # the key a config writes (`as`, a keyword, is an alias)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            rows.extend(describe_fields(ann, path + "."))
            continue
        if get_origin(ann) is Union and all(_is_section(a) for a in get_args(ann)):
            rows.extend(_describe_union([_section_of(a) for a in get_args(ann)], path + "."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((path, default, field.description or ""))
        if (item := _listed_section(ann)) is not None:
            rows.extend(describe_fields(item, path + "[]."))  # each item's fields
        elif optional := _optional_section(ann):  # a section that may be null: its row, then its fields
            rows.extend(describe_fields(optional, path + "."))
    return rows


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    """``describe_fields`` rows as the Markdown table ``config-doc`` prints."""
    lines = ["| key | default | description |", "| --- | --- | --- |"]
    for path, default, desc in rows:
        desc = desc.replace("|", "\\|")  # a pipe in a description would end its table cell
        lines.append(f"| `{path}` | `{default}` | {desc} |")
    return "\n".join(lines)


def _listed_section(ann: Any) -> type[BaseModel] | None:
    """``S`` for an annotation ``list[S]`` or ``list[S] | None`` with ``S`` a section; else None."""
    args = get_args(ann) if get_origin(ann) is Union or type(ann).__name__ == "UnionType" else (ann,)
    lists = [a for a in args if get_origin(a) is list and _is_section(get_args(a)[0])]
    return _section_of(get_args(lists[0])[0]) if len(lists) == 1 else None


def _optional_section(ann: Any) -> type[BaseModel] | None:
    """``S`` for an annotation ``S | None`` with ``S`` a section; else None."""
    args = get_args(ann) if get_origin(ann) is Union or type(ann).__name__ == "UnionType" else ()
    members = [a for a in args if a is not type(None)]
    if len(args) == 2 and len(members) == 1 and _is_section(members[0]):
        return _section_of(members[0])
    return None


def _section_of(ann: Any) -> Any:
    return get_args(ann)[0] if get_origin(ann) is Annotated else ann


def _is_section(ann: Any) -> bool:
    cls = _section_of(ann)
    return isinstance(cls, type) and issubclass(cls, Section)


def _describe_union(members: list[type[BaseModel]], prefix: str) -> list[tuple[str, str, str]]:
    """A discriminated union's fields, each once, each description prefixed by the recipes that read it."""
    seen: dict[str, dict[tuple[str, str], list[str]]] = {}
    for member in members:
        recipe = get_args(member.model_fields["recipe"].annotation)[0]
        for path, default, desc in describe_fields(member, prefix):
            if path.endswith(".recipe"):
                default, desc = "'ppo'", "Training recipe: ppo (default), sft, rm or dpo (docs/stages.md)."
            seen.setdefault(path, {}).setdefault((default, desc), []).append(recipe)
    rows = []
    for path, variants in seen.items():
        if len(variants) == 1 and len(next(iter(variants.values()))) == len(members):
            (default, desc), _ = next(iter(variants.items()))
            rows.append((path, default, desc))
            continue
        defaults = " / ".join(dict.fromkeys(d for d, _ in variants))
        desc = " ".join(f"[{', '.join(r)}] {d}" for (_, d), r in variants.items())
        rows.append((path, defaults, desc))
    return rows
