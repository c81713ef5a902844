"""The graded suite's runtime: what stages are called (``stage_names``), the one door between the tests and an
implementation (``adapters``) and the inputs of randomized cases (``cases``).

The grader imports ``stage_names`` and ``adapters`` (a grading box holds copies of just those two), and the
fixture generators use ``cases``; none of them imports the diagnosis engine, the suite's pytest plugin or the
grader (kit_tests/test_kit.py holds them to it).
"""
