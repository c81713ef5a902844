"""Which stage test files a run collects: with ``-m`` naming stages (``pytest -m causal_attention``, a student's
loop), the other stages' files are not even imported.

Every test of a stage's file carries the stage's marker (its ``pytestmark``), and besides it only markers of the
suite's own (public, book, gpu). A file is left out when the ``-m`` expression is false for every test it could
hold: the stage's marker with any choice of the others. Anything this cannot read (pytest's expression syntax
changed, a marker it does not know) keeps the file: pytest's own selection then decides, as without this module.
"""
from __future__ import annotations

from itertools import combinations

from suite_runtime.stage_names import marker, stage_of

TEST_MARKERS = ("public", "book", "gpu")  # what a stage's test may carry besides its stage's marker


def pytest_ignore_collect(collection_path, config):
    expression = config.getoption("markexpr", "")
    stage = stage_of(collection_path.name) if collection_path.suffix == ".py" else None
    if not expression or stage is None:
        return None
    try:
        from _pytest.mark.expression import Expression  # (pytest's own parser of -m)

        compiled = Expression.compile(expression)
        for size in range(len(TEST_MARKERS) + 1):
            for others in combinations(TEST_MARKERS, size):
                present = frozenset({marker(stage), *others})
                if compiled.evaluate(lambda name, /, present=present, **kwargs: name in present):
                    return None  # some test of this file may be selected
    except Exception:
        return None
    return True
