"""Text a student controls, made inert wherever an instructor reads it.

Student ids (the names of submission folders), failure messages, diagnosed mistakes and whatever a
learner's code printed or raised reach the instructor's terminal, ``grades.csv``, the class report (its
HTML and its plots), nbgrader's gradebook and formgrader, and file names. Each of those places reads
some characters as commands: a terminal acts on control characters (ESC sequences move the cursor,
recolour or hide text; U+202E reverses what follows), a spreadsheet runs a cell that starts with ``=``,
``+``, ``-``, ``@``, a tab or a carriage return as a formula (OWASP, "CSV Injection"), matplotlib parses
``$...$`` as mathtext (a bad expression aborts the whole figure), HTML and nbgrader's formgrader (whose
templates do not escape student ids) read ``<``, ``&`` and quotes, and a file system reads ``/``.

- ``printable``: for the terminal (and plot labels): every character that is not printable is shown as
  its escape (``\\x1b``, ``\\u202e``), so that the text is seen for what it is and does nothing.
- ``csv_cell``: for spreadsheets: OWASP's rule, a cell starting with one of ``= + - @``, a tab or a
  carriage return gets a leading ``'`` (the csv module quotes the rest).
- ``id_problem``: a student id is used as it is: as a file name (``<student>.json``), a gradebook key,
  and raw in nbgrader's formgrader pages. One that cannot be all of these safely is refused, and this
  says why, so that its folder can be renamed; ``ID_RULE`` says what a good one is.

HTML is escaped where it is written (``grader.outputs.report``), and plots are drawn without mathtext or TeX
(``grader.outputs.report.plain_text``).
"""
from __future__ import annotations

CSV_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")  # OWASP: a spreadsheet reads a cell starting so as a formula
ID_MAX_CHARS = 128  # nbgrader's gradebook keeps a student id in a VARCHAR(128) (PostgreSQL enforces it)
ID_MAX_BYTES = 200  # <id>.json and its temporary twin .<id>.json.XXXXXXXX.tmp stay within a file name's 255 bytes
ID_PUNCTUATION = "._-@+ "  # besides letters and digits: what user names, e-mail addresses and full names use
ID_RULE = ("a student id must be a safe file name: letters, digits and . _ - @ + (spaces inside), starting "
           f"with a letter, a digit or _, at most {ID_MAX_CHARS} characters")


def printable(text, newlines: bool = False) -> str:
    """``text`` with each character a terminal would act on (control and format characters, lone
    surrogates of undecodable bytes) written as its escape; newlines kept with ``newlines``."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (newlines and c == "\n") else ascii(c)[1:-1] for c in text)


def csv_cell(value):
    """``value`` as a spreadsheet may take it: a string a spreadsheet would run as a formula gets a
    leading apostrophe (shown, never run); anything else is left as it is."""
    if isinstance(value, str) and value.startswith(CSV_TRIGGERS):
        return "'" + value
    return value


def id_problem(student: str) -> str | None:
    """Why ``student`` cannot be a student id (None: it can): see ``ID_RULE``."""
    if not student:
        return "the name is empty"
    try:
        size = len(student.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: the folder's name is not valid UTF-8
        return "the name is not valid UTF-8 text"
    if not student.isprintable():
        return "the name holds a control or invisible character"
    bad = sorted({c for c in student if not (c.isalnum() or c in ID_PUNCTUATION)})
    if bad:
        return f"the name holds {', '.join(map(repr, bad))}"
    if not (student[0].isalnum() or student[0] == "_"):
        return f"the name starts with {student[0]!r}"
    if student != student.strip() or "  " in student:
        return "the name ends with a space or holds two in a row"
    if len(student) > ID_MAX_CHARS or size > ID_MAX_BYTES:
        return f"the name is too long ({len(student)} characters, {size} bytes)"
    return None
