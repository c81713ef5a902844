"""attention-kit's grading engine and instructor tools (the ``attnkit`` command).

Where things are and what stages are called: ``grader.kit``. How a submission is graded:
``submission`` (what is read of it) -> ``worker`` (a pytest run of the graded suite with the
``plugin``, learner code in the ``sandbox``) -> ``scoring`` and ``results`` (points, records).
``grade`` grades a class through the ``dispatch`` pools into the ``gradebook``; ``cells`` is the
side nbgrader's autograder cells run. The graded suite itself (tests/) never imports this package.
"""
