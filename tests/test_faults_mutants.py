"""``make mutants`` stays runnable: every mutant in tests/mutants.py still applies to this tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import mutants

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_still_finds_its_old_text_once(m: mutants.Mutant) -> None:
    """Each revert's old text occurs exactly once where it points, so the mutant is not stale."""
    assert mutants.check_edits(ROOT, m) is None
    for t in m.tests:
        assert (ROOT / t.split("::")[0]).is_file(), f"{m.name}: no test file {t}"


def test_a_stale_mutant_is_named_as_such(tmp_path: Path) -> None:
    """A mutant whose old text is gone is reported stale, with the file it looked in."""
    (tmp_path / "kvxferd").mkdir()
    (tmp_path / "kvxferd" / "x.py").write_text("a = 1\n")
    stale = mutants.Mutant("m", "why", (mutants.Edit("kvxferd/x.py", "b = 2", "b = 3"),), ())
    problem = mutants.check_edits(tmp_path, stale)
    assert problem is not None and "not found" in problem and "kvxferd/x.py" in problem
