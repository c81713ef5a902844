"""The graded suite's runtime: what stages are called (``stage_names``), the one door between the tests and an
implementation (``adapters``) and the inputs of randomized cases (``cases``).

The grader imports ``stage_names`` and ``adapters`` (a grading box holds copies of just those two), and the
fixture generators use ``cases``; none of them imports the diagnosis engine, the suite's pytest plugin or the
grader (kit_tests/test_kit.py holds them to it).
"""

# What a course may choose for the kernels' speed checks that cannot run where it grades (no GPU, or kernels in
# Triton's interpreter): "skip" leaves them out of the stage's count, "count" fails them. The one list of them: the
# suite's speed checks (suite_plugin.speed) and the grader's course settings both read it here (the root conftest,
# which cannot import this package in a student's folder, repeats it; kit_tests check that the two agree).
from typing import Literal, get_args

SpeedChecks = Literal["skip", "count"]
SPEED_CHECK_POLICIES: tuple[SpeedChecks, ...] = get_args(SpeedChecks)
DEFAULT_SPEED_CHECKS: SpeedChecks = "skip"  # a course's choice unless it makes another
