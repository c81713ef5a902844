"""attention-kit's instructor side: stubs, fixtures, grading (CLI: ``attnkit``)."""
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
SOLUTIONS = KIT / "solutions"
EXERCISES = KIT / "exercises"
FIXTURES = KIT / "fixtures"
TESTS = KIT / "tests"
