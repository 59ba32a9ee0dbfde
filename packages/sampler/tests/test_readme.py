"""The README's examples run and print what it says."""

from __future__ import annotations

import doctest
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_hold() -> None:
    result = doctest.testfile(str(README), module_relative=False, raise_on_error=False)
    assert result.attempted >= 15
    assert result.failed == 0
