"""The package's own metadata: every file ``pyproject.toml`` names exists,
so building an sdist or wheel (and ``pip install``) gets the description
and never trips over a missing file."""

from __future__ import annotations

import tomllib
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def test_the_readme_named_in_pyproject_exists_and_points_to_the_docs() -> None:
    meta = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    readme = meta["readme"]
    path = PROJECT / (readme if isinstance(readme, str) else readme["file"])
    assert path.is_file(), f"pyproject.toml names {path.name}, which does not exist"
    text = path.read_text()
    assert "pip install" in text and "lockrouter.Client(" in text
    assert "docs/client.md" in text
