"""``attnkit doctor``: which confinement holds on this machine, what each of its guarantees rests on, and what to
change to get a stronger one.

It starts a sandbox as a grading run does (the strongest confinement that works here, proven by a probe box before
anything else: ``template.Sandbox.start``), and says what it found, in the words records and announcements use
(``confinement``), with what the kernel does for each guarantee and what the stronger confinements that failed
said. Nothing is graded and nothing of the kit changes, except what a grading run changes too (``container``: the
kit's private folders made private to root).
"""
from __future__ import annotations

import os
import time

from .confinement import GUARANTEES, MODES, Confinement, ConfinementRefused, SandboxUnavailable, candidate_modes
from .template import Sandbox

RESTS_ON = {  # guarantee -> what enforces it, by confinement (a mode not named: as "namespaces")
    "files": {"namespaces": "a mount namespace per sandbox whose root file system holds only the system's folders, "
                            "the Python installation and the folders it imports from (read-only); each box sees its "
                            "own submission only",
              "container": "file permissions: the kit's private folders and the course made private to root before "
                           "the first box (grader/sandbox/lockdown.py), each box a fresh uid; proven by a probe box"},
    "mount": {"namespaces": "a fresh mount namespace per box: its own /proc, /tmp and /dev/shm"},
    "processes": {"namespaces": "a pid namespace per box, a fresh uid, no ptrace or signal beyond its own process (the "
                                "learner's filter), processes that cannot be dumped",
                  "container": "a fresh uid per box, processes that cannot be dumped (no /proc/<pid>/mem), no ptrace "
                               "or signal beyond its own process (the learner's filter)",
                  "plain": "nothing but the learner's filter (no ptrace, signals to its own process only)"},
    "pid": {"namespaces": "a fresh pid namespace per box; killing its first process kills every process of it"},
    "uid": {"namespaces": "root's setuid to a fresh uid per box (1.5-2.1 billion), no groups, no_new_privs"},
    "system calls": {"namespaces": "the learner's seccomp filter (grader/sandbox/seccomp.py), loaded before any "
                                   "learner code, for good"},
    "keyring": {"namespaces": "a fresh session keyring per box, and a seccomp filter on the keyring calls"},
    "cgroup": {"namespaces": "a cgroup per box (v2 or v1) that counts the CPU time of all its processes"},
    "cgroup limits": {"namespaces": "the cgroup's memory and pids controllers"},
}
HOW_TO_GET = {  # guarantee -> what to change where it is missing
    "files": "grade as root (namespaces), or in a container as root (container); never with --allow-plain",
    "mount": "grade as root where namespaces can be made: outside a container, or in one given CAP_SYS_ADMIN "
             "(docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined)",
    "processes": "grade as root (a fresh uid per box), with namespaces where they can be made",
    "pid": "as for mount: namespaces need root with CAP_SYS_ADMIN (or unprivileged user namespaces)",
    "uid": "grade as root: without root, boxes keep your uid (userns) or run as you (plain)",
    "system calls": "a Linux kernel with seccomp filters, on x86_64 or aarch64",
    "keyring": "a Linux kernel with seccomp filters",
    "cgroup": "let this process make cgroups: root with a writable cgroup tree (/sys/fs/cgroup), or a delegated "
              "subtree (systemd-run --user -p Delegate=yes ...; in Docker, --cgroupns=private with a writable "
              "/sys/fs/cgroup)",
    "cgroup limits": "enable the memory and pids controllers in that cgroup (its parent's cgroup.subtree_control)",
}


def rests_on(mode: str, guarantee: str) -> str:
    found = RESTS_ON[guarantee]
    return found.get(mode) or found.get("namespaces")


def report(confine: str | None = None, allow_plain: bool = False) -> tuple[list[str], int]:
    """What ``attnkit doctor`` prints, and its exit status (0: the strongest confinement holds; 1: a weaker one;
    2: none)."""
    started = time.monotonic()
    lines = [f"attnkit doctor: how learner code is confined here (uid {os.geteuid()}; confinements tried, strongest "
             f"first: {', '.join(candidate_modes(allow_plain)) or 'none'})"]
    with Sandbox(confine=confine, allow_plain=allow_plain) as sandbox:
        try:
            found: Confinement = sandbox.start()
        except (ConfinementRefused, SandboxUnavailable) as exc:
            return lines + [f"no confinement holds: {exc}"], 2
        lines.append(f"{found.summary()} (started and proven by a probe box in {time.monotonic() - started:.1f} s)")
        if found.why:
            lines.append(f"stronger confinements failed: {found.why}")
        lines.append("what each guarantee rests on here:")
        for guarantee, meaning in GUARANTEES.items():
            held = guarantee not in found.missing
            lines.append(f"  [{'holds' if held else 'MISSING'}] {guarantee}: {meaning}")
            lines.append(f"      {'rests on' if held else 'to get it'}: "
                         f"{rests_on(found.mode, guarantee) if held else HOW_TO_GET[guarantee]}")
        if sandbox.import_path:
            lines.append("boxes import from: " + ", ".join(sandbox.import_path))
        if sandbox.left_out:
            lines.append("left out of the boxes' view (they hold or lie inside what boxes must not reach): "
                         + ", ".join(sandbox.left_out))
        if found.private:
            lines.append("made private to root before the first box: " + ", ".join(found.private))
    strongest = found.mode == MODES[0] and not found.missing
    return lines, 0 if strongest else 1
