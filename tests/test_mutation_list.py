"""scripts/mutation/check_planted_mutations.py's list stays in step with the code: every planted bug's snippet
occurs exactly once in its file, every mutated file parses, and every selected test exists (the
script refuses a stale list; this catches it in the suite, not at the next mutation run)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "mutation"))

import check_planted_mutations  # noqa: E402


def test_every_planted_mutation_still_applies_to_the_code():
    check_planted_mutations.check_mutations(ROOT, check_planted_mutations.MUTATIONS)
