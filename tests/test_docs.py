"""The README stays true to the code: every setting and every command is documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokensvc.cli.main import build_parser
from tokensvc.settings import Settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_every_setting_is_in_the_readme() -> None:
    missing = [f.name for f in dataclasses.fields(Settings) if f"`{f.name}`" not in README]
    assert not missing, f"document these settings in README.md: {missing}"


def test_every_top_level_command_is_in_the_readme() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)).choices
    missing = [name for name in commands if f"tokensvc {name}" not in README]
    assert not missing, f"document these commands in README.md: {missing}"
