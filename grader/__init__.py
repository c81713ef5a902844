"""attention-kit's grading engine and instructor tools (the ``attnkit`` command).

In layers, lowest first; a module imports from its own layer and those below it, never above
(kit_tests/test_kit.py holds it to that):

    kit, suite, submission,    the facts: where the kit's files are, its assignments and stages (kit), the graded
    untrusted, errors          suite's public part (suite), what is read of a submission (submission), text a
                               student controls (untrusted), the errors a user acts on (errors)
    authoring/                 the stubs and the fixtures, made from the reference solutions
    sandbox/                   where learner code runs: limits, confinement, the template and its boxes, the
                               backend the suite's hook gets, the wire format both sides share
    grading/                   a pytest run of the graded suite per submission (worker, plugin), its verdicts,
                               scores and records, and `attnkit grade` (targets, dispatch, run)
    outputs/                   what is made of the records: the class report, Gradescope's autograder
    course/                    the nbgrader side: a course and its releases, the notebook, nbgrader's steps,
                               the gradebook, feedback, the autograder cells, the samples and the demo
    cli                        the command line

The graded suite itself (tests/) never imports this package; course content (assignments/) is data.
"""
