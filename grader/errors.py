"""What the kit raises when the instructor's input, or the machine, stops a command: errors with a message
that says what to do (the command line prints it and exits with 2)."""
from __future__ import annotations


class AttnkitError(Exception):
    """A problem the user can act on, described in its message."""


class CourseError(AttnkitError):
    """Bad input for a course build, or a course that cannot be read."""
