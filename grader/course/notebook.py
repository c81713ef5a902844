"""An assignment's notebook, made from its record (grader.kit): what each stage is about, its demo, its checks,
and one locked autograder cell per stage.

Learners write their code in the stage modules (``sNN_topic.py`` ...), not in the notebook. The
notebook opens with the assignment's intro (its Markdown, read as a Jinja2 template: ``stages``, and the filter
``in_words``, so that no count goes stale), then per stage a heading with its title and points, its lesson
(lessons/<module>.md), a demo cell with its demo's code (demos/<module>.py) and the check of its public tests,
and its autograder cell; last, the outro.

A demo runs in the kernel with the course's time limit per check, and check() runs pytest in a subprocess,
where pytest.ini sets the same limit per check, with a backstop on the whole run: both come from
``notebook_tools.py``, which the release ships beside the notebook and its setup cell imports
(templates/setup_cell.py.j2).

Every code cell is locked (nbgrader restores it from the source at grading time). Demo and check cells do
nothing when nbgrader executes the notebook (it sets NBGRADER_EXECUTION), so grading never imports learner code
into the kernel; the autograder cells grade the submission folder through ``grader.course.cells.Grading``,
which runs the suite in a grading worker process.
"""
from __future__ import annotations

import ast
import io
import tokenize

import jinja2
import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks
from suite_runtime.stage_names import MODULE, stage_command

from .. import kit
from ..errors import AssignmentError

TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("grader.course", "templates"), keep_trailing_newline=True,
                               undefined=jinja2.StrictUndefined)
# Tokens of a string literal's text (an f-string's in pieces from Python 3.12 on).
STRINGS = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen twenty").split()


def in_words(count: int) -> str:
    """A count as prose writes it: 7 -> 'seven' (up to twenty; beyond, in digits)."""
    return NUMBERS[count] if 0 <= count < len(NUMBERS) else str(count)


def prose(text: str, assignment: kit.Assignment) -> str:
    """An assignment's intro or outro: its Markdown with the counts and names it computes filled in."""
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    environment.filters["in_words"] = in_words
    return environment.from_string(text).render(stages=assignment.stages, assignment=assignment)


def demo_code(path) -> str:
    """A demo script's code as the body of the notebook's ``@demo(stage) def show():`` (its names stay local):
    indented, without the script's docstring, the lines inside a multi-line string left as they are."""
    try:
        source = path.read_text()
    except FileNotFoundError:
        raise AssignmentError(f"{path} is missing: every stage has a demo (a script that imports its module and "
                              "prints what it computes)") from None
    lines = source.splitlines()
    body = ast.parse(source).body
    first = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        first = body[0].end_lineno  # (the docstring says what the file is; the notebook's lesson says it there)
    inside = set()  # lines that continue a multi-line string: indenting them would change the string
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in STRINGS and token.end[0] > token.start[0]:
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    kept = [(number, line) for number, line in enumerate(lines, start=1) if number > first]
    while kept and not kept[0][1].strip():
        kept.pop(0)
    return "".join(line + "\n" if number in inside or not line else f"    {line}\n" for number, line in kept)


def lesson(assignment: kit.Assignment, stage: str) -> str:
    try:
        return assignment.lesson(stage).strip("\n")
    except FileNotFoundError:
        raise AssignmentError(f"{assignment.folder / 'lessons' / f'{stage}.md'} is missing: every stage has a "
                              "lesson (its title is in assignment.toml)") from None


def _meta(grade_id, *, grade=False, points=None):
    nb = {"grade": grade, "grade_id": grade_id, "locked": True, "schema_version": 3, "solution": False, "task": False}
    if grade:
        nb["points"] = points
    return {"nbgrader": nb, "editable": False, "deletable": False}


def grade_source(stage: kit.Stage, points: float, test_timeout: float, time_budget: float | None = None,
                 first: bool = False, speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> str:
    """An autograder cell. The first grades the submission (grader.course.cells.Grading), with the course's time
    limits and its choice for speed checks that cannot run (``speed_checks``); each reports its stage.

    Its first line is the stage's heading, which the feedback page shows as the cell's name (see
    grader.course.feedback). Students see only the comments: nbgrader removes the hidden region from the
    release, puts it back for grading, and the feedback page leaves it out again."""
    options = f", time_budget={time_budget!r}" if time_budget is not None else ""
    # (written only where it is not Grading's default: the cells of a course that keeps the default stay as they were)
    options += f", speed_checks={speed_checks!r}" if speed_checks != DEFAULT_SPEED_CHECKS else ""
    grading = (f"from grader.course.cells import Grading\n"
               f"grading = Grading({stage.assignment!r}, test_timeout={test_timeout!r}{options})\n")
    return (
        f"# {stage.heading}\n"
        f"# Autograder cell ({points:g} points): graded with the public and hidden tests when you submit;\n"
        "# the verdicts appear here in your feedback. To check your work now, run\n"
        f"# check({stage.marker!r}) or `{stage_command(stage.module)}`.\n"
        "### BEGIN HIDDEN TESTS\n"
        f"{grading if first else ''}"
        f"grading.stage({stage.marker!r}, points={points!r})\n"
        "### END HIDDEN TESTS"
    )


def setup_source(test_timeout: float) -> str:
    """The setup cell: notebook_tools.py set to the course's time limit (templates/setup_cell.py.j2)."""
    packages = tuple(name.replace("-", "_") for name in kit.STUDENT_PACKAGES)
    return TEMPLATES.get_template("setup_cell.py.j2").render(
        time_limit=repr(float(test_timeout)), stage_module=MODULE.pattern, packages=repr(packages)).rstrip("\n")


def build_notebook(assignment: str, points: dict[str, float], test_timeout: float, time_budget: float | None = None,
                   speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> nbformat.NotebookNode:
    """The source notebook of ``assignment``; ``points`` maps each of its stage modules to its points (teaching
    order); ``test_timeout`` and ``time_budget`` are the course's time limits (grader.sandbox.limits.Limits),
    ``speed_checks`` its choice for speed checks that cannot run (grader.course.settings.Course)."""
    record = kit.assignment(assignment)
    title, _, text = prose(record.intro, record).partition("\n\n")
    setting_up = TEMPLATES.get_template("setting_up.md").render().rstrip("\n")
    setting_up += " The next code cell says what is missing.\n"
    cells = [new_markdown_cell(f"{title}\n\n{setting_up}\n{text}"),
             new_code_cell(setup_source(test_timeout), metadata=_meta("setup"))]
    for number, (module, stage_points) in enumerate(points.items(), start=1):
        stage = kit.stage_info(module)
        cells.append(new_markdown_cell(
            f"## {stage.heading} ({stage_points:g} points)\n\n"
            f"Module: `{module}.py` · tests: `{stage_command(module)}`\n\n{lesson(record, module)}"
        ))
        demo = f"@demo({module!r})\ndef show():\n{demo_code(record.demo(module)).rstrip()}\n"
        demo += f"\n\ncheck({stage.marker!r})  # this stage's public tests on your module"
        cells.append(new_code_cell(demo, metadata=_meta(f"demo_{module}")))
        cells.append(new_code_cell(grade_source(stage, stage_points, test_timeout, time_budget, first=number == 1,
                                                speed_checks=speed_checks),
                                   metadata=_meta(f"grade_{module}", grade=True, points=stage_points)))
    cells.append(new_markdown_cell(prose(record.outro, record)))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb
