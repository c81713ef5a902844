"""[attnkit-tamper] run_program -- family (e), a program started from learner code.

Append to a stub. At import, run a fresh Python (``python -I``: no stage-memory ceiling, none of the
box's state) that would compute the stage's answer elsewhere. Expected: no program can be started (the
learner's filter denies fork and exec); the stub gets its 0 points.
"""


def _atk_run():
    import subprocess
    import sys

    try:
        subprocess.run([sys.executable, "-I", "-c", "print('RAN')"], timeout=10)
    except OSError:
        pass


_atk_run()
