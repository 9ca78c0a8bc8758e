"""A checkpoint's fsync walk next to another rank's writes (learner/checkpoint.py): two ranks that each lead
a node (node-local storage, or two "nodes" on one host as the Ray tier runs them) walk the same state folder
while the other renames its ``rng_rank<N>.json.tmp`` into place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from learner import checkpoint


def test_a_file_renamed_away_during_the_walk_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "rng_rank1.json").write_text("{}")
    real_walk = os.walk

    def walk_listing_a_vanished_file(root):  # the other rank renamed it after the listing
        for dirpath, dirs, files in real_walk(root):
            yield dirpath, dirs, [*files, "rng_rank0.json.tmp"]

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(checkpoint.os, "walk", walk_listing_a_vanished_file)
    monkeypatch.setattr(
        checkpoint.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    checkpoint._fsync_tree(tmp_path)
    assert str(tmp_path / "rng_rank1.json") in synced and str(tmp_path) in synced


def test_any_other_error_still_stops_the_save(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a").write_text("x")

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint.os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output"):
        checkpoint._fsync_tree(tmp_path)
