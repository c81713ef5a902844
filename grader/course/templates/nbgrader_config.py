"""nbgrader's configuration of an attention-kit course. This file is the same in every course (`attnkit course
build` copies it here): what is this course's own (its id, gradebook, exchange, assignments, time limits) is in
attnkit-course.json beside it. Change those by rebuilding the course, not by editing this file."""
import logging
import os
import sys

from grader.course.settings import Course

HERE = os.path.dirname(os.path.abspath(__file__))
c = get_config()  # noqa: F821 (provided by nbgrader)
course = Course.load(HERE)

# nbgrader runs `alembic` when it creates the gradebook: find it next to this Python even when
# the virtual environment is not activated.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

c.CourseDirectory.course_id = course.course_id
c.CourseDirectory.root = HERE
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".pytest_cache",
                            "attnkit-grading.json"]
if course.db_url:  # (else the gradebook is HERE/gradebook.db, SQLite)
    c.CourseDirectory.db_url = course.db_url
c.Exchange.root = str(course.exchange)

# Students write code in the stage modules; the notebook has no solution cells.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# nbgrader logs "Copying SRC -> DEST" at INFO for every file it copies (the suite's support files: a hundred lines at
# each generate_assignment and autograde), which buries its other lines; they still show with --log-level=DEBUG.
def _not_a_file_copied(record):
    shown = min((handler.level for handler in logging.getLogger(record.name).handlers), default=logging.INFO)
    return record.msg != "Copying %s -> %s" or shown <= logging.DEBUG


for _app in ("GenerateAssignmentApp", "AutogradeApp"):
    logging.getLogger(_app).addFilter(_not_a_file_copied)

# Autograde: the kernel is python3; each autograder cell may run the whole suite (first cell).
c.Execute.kernel_name = "python3"
# The kernel's own warnings at start: ipykernel warns "Kernel is running over TCP without encryption" at every
# autograde, though its ports listen on this machine only and each kernel has a key of its own; no learner code runs
# in the kernel (grader.course.cells grades in the sandbox). Its errors still show.
c.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]
c.Execute.timeout = course.execute_timeout
c.OverwriteCells.add_missing_cells = True
# Keep the student's modules: nbgrader otherwise overwrites every file with the source's.
c.Autograde.exclude_overwriting = course.exclude_overwriting
# Steps are named by import strings, which nbgrader resolves as it uses them: the formgrader shows
# this configuration as JSON, and a class in it would not serialize (a warning on every visit).
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "grader.course.preprocessors.KeepCourseCells",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "nbgrader.preprocessors.OverwriteCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.Autograde.autograde_preprocessors = [
    "grader.course.preprocessors.SafePathExecute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
# Feedback: each autograder cell named by its stage, without the hidden tests (grader.course.feedback).
c.GenerateFeedback.exporter_class = "grader.course.feedback.FeedbackPage"
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "grader.course.feedback.FeedbackCells",
]

# The formgrader would show its whole configuration on Manage Assignments, and Jupyter's own settings
# in it cannot be shown as JSON: 'Formgrader config is not serializable' on every visit. True shows it.
c.FormgradeExtension.debug = False

# zip_collect (LMS downloads): files named <student>_<file>, e.g. alice_<stage module>.py
c.FileNameCollectorPlugin.named_regexp = r".*/(?P<student_id>[^/_]+)_(?P<file_id>[^/]+)$"
c.FileNameCollectorPlugin.valid_ext = [".ipynb", ".py"]  # the notebook and the stage modules
