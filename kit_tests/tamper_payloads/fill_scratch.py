"""[attnkit-tamper] fill_scratch -- family (d), the scratch space filled.

Append to a stub. At import, write as much as it can into /tmp, /dev/shm, the home folder and the working
folder (what a later submission, or the grader itself, would then lack). Expected: nothing can be written
(learner code opens files to read only); the stub gets its 0 points and the run goes on.
"""


def _atk_fill():
    import os

    block = b"\0" * (1 << 20)
    for folder in ("/tmp", "/dev/shm", os.path.expanduser("~"), "."):
        try:
            with open(os.path.join(folder, "attnkit-fill"), "wb") as handle:
                for _ in range(4096):
                    handle.write(block)
        except OSError:
            pass


_atk_fill()
