"""[attnkit-tamper] grader_places -- a prelude: where the grader is, found as an attacker finds it.

``_atk_grader_processes()`` lists the processes of the grading run that are not this box's (their pid and
command line: /proc shows every process's where there is no pid namespace); ``_atk_places()`` the folders
those command lines name (a course, Gradescope's root, a kit) and the ones ``ATTACK`` gives.
"""


def _atk_grader_processes():
    import os

    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in command if w]
        if any("grader" in w or "nbgrader" in w or "pytest" in w or "run_autograder" in w for w in words):
            found.append((int(name), words))
    return found


def _atk_places():
    import os

    places = [v for v in globals().get("ATTACK", {}).values() if isinstance(v, str)]
    for _, words in _atk_grader_processes():
        for i, word in enumerate(words):
            if word in ("--root", "--course", "--settings") and i + 1 < len(words):
                places.append(words[i + 1])
            elif word.startswith("--impl="):
                places.append(word[len("--impl="):])
            elif os.path.isabs(word) and ("autograder" in word or "kit" in word):
                places.append(word)
    return list(dict.fromkeys(places))
