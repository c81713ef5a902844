"""What the kit raises when the instructor's input, or the machine, stops a command: errors with a message
that says what to do. Every one derives from ``AttnkitError``, which the command line prints as
``attnkit COMMAND: error: MESSAGE`` and exits with 2 (grader/cli.py, its one handler)."""
from __future__ import annotations


class AttnkitError(Exception):
    """A problem the user can act on, described in its message."""


class AssignmentError(AttnkitError):
    """An assignment's record (assignments/<name>/assignment.toml) or its files, which the kit cannot use."""


class StubError(AttnkitError):
    """A reference solution whose learner regions (### BEGIN/END SOLUTION) cannot be made into a stub."""


class CourseError(AttnkitError):
    """Bad input for a course build, or a course that cannot be read."""


class SampleError(AttnkitError):
    """Samples that cannot be put into a course as asked."""


class TargetError(AttnkitError):
    """No course, assignment or submissions where they were looked for."""


class GradeError(AttnkitError):
    """A problem with how a grading run was asked for, or a machine where nothing can be graded."""


class GradebookError(AttnkitError):
    """The gradebook cannot take this course's grades, or cannot be read."""


class SchedulerError(AttnkitError):
    """The Dask scheduler cannot be used (or Dask is not installed)."""


class ReportError(AttnkitError):
    """Missing or unreadable input for a class report."""


class UploadError(AttnkitError):
    """A Gradescope upload with no stage module of the assignment where the autograder looks: says what to
    upload (the student reads it)."""
