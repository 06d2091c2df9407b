"""Drafters shipped with the package, one z-lab-format directory each."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_NAME = "smollm2-135m-instruct-dflash"


def default_draft_dir() -> str | None:
    """The drafter for the embedded default target, if this build bundles one."""
    path = Path(__file__).resolve().parent / DEFAULT_DRAFT_NAME
    return str(path) if (path / "config.json").is_file() else None
