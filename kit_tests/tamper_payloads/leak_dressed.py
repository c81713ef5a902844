"""[attnkit-tamper] leak_dressed -- family (n), hidden text dressed so that a person reads it and a matcher does not.

Append to the stub of a stage whose graded parts are functions, with ``ATTACK = {"text": ..., "dress": ...}``
before it: ``text`` is hidden material (a reference's solution region, a hidden test) rot13-encoded, as code that got
it from somewhere would hold it (the submission itself never holds it plainly, so it cannot count as the student's
own); ``dress`` says how it is shown: "zwsp" or "bar" (a zero-width space or "|" after every 39 characters other than
whitespace: the old matcher's windows were 40 of those), "loud" (upper case, fullwidth letters), "stderr" (a soft
hyphen after every 39, written to stderr, then the process exits, so that the grader quotes its last output). Every
graded function of the module then does that instead of its work.

Expected: the stage's honest grade (the stub's: 0), and no hidden text in any output: "[hidden material removed]"
where it was.
"""


def _atk_dressed():
    import codecs

    text = codecs.decode(ATTACK["text"], "rot13")
    dress = ATTACK["dress"]

    def every(separator, count=39):
        out, seen = [], 0
        for c in text:
            out.append(c)
            if not c.isspace():
                seen += 1
                if seen % count == 0:
                    out.append(separator)
        return "".join(out)

    if dress == "zwsp":
        return every("\u200b")
    if dress == "bar":
        return every("|")
    if dress == "loud":
        return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text.upper())
    return every("\u00ad")


def _atk_leaking(name):
    def leak(*args, **kwargs):
        import os
        import sys

        if ATTACK["dress"] == "stderr":
            sys.stderr.write(_atk_dressed() + "\n")
            sys.stderr.flush()
            os._exit(1)
        raise RuntimeError(f"{name}: here is what I found:\n{_atk_dressed()}")

    leak.__name__ = name
    return leak


for _atk_name, _atk_value in list(globals().items()):
    if callable(_atk_value) and getattr(_atk_value, "__module__", None) == __name__ and not _atk_name.startswith("_"):
        globals()[_atk_name] = _atk_leaking(_atk_name)
