"""How well boxes are kept apart on this machine: the confinements, strongest first, and the probe that
finds the strongest one that holds (no template is started for it).

``namespaces``  (root) fresh mount, pid, network, IPC and UTS namespaces and a fresh uid per box
``userns``      (no root; unprivileged user namespaces) the same, except the uid: the box keeps
                the grader's uid, inside a nested user namespace that owns nothing
``container``   (root without namespaces: Docker's default profile) a fresh uid per box, the learner's
                filter, and what boxes must not reach made private to root first (``lockdown``)
``plain``       neither: a child process with resource limits, and no isolation at all (only where the
                instructor allows it)

``Sandbox.confinement`` says which holds and what is missing; a grading run reports it at the start and in
every record, and the kit's tests fail where it is weaker than the README promises.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from typing import TypedDict

from ..errors import AttnkitError
from .cgroups import BoxGroup
from .syscalls import AUDIT_ARCH

GUARANTEES = {  # what keeps one submission from reaching another, by the name a Confinement lists
    "files": "the kit's solutions, hidden tests and fixtures, the grader, the gradebook and other submissions out of "
             "its reach",
    "mount": "a private root file system for each submission (only the Python installation and its own modules "
             "in it)",
    "processes": "the grader's, other submissions' and its own box's serving processes out of its reach (no "
                 "signals, tracing, memory or open files)",
    "pid": "a fresh pid namespace for each submission (other processes not even listed)",
    "uid": "a fresh unprivileged uid for each submission",
    "system calls": "learner code that cannot run programs, start processes, write files, or open sockets or IPC "
                    "objects (a seccomp filter)",
    "keyring": "no access to the kernel's keyrings",
    "cgroup": "a cgroup for each submission (the CPU time of all its processes counted, dead ones included)",
    "cgroup limits": "the memory and number of a submission's processes bounded together (cgroup memory and "
                     "pids controllers; without them, only each process's own limits)",
}
CGROUP_GUARANTEES = ("cgroup", "cgroup limits")  # held wherever this process may give boxes cgroups
HOLDS = {  # by the confinement's mode
    "namespaces": tuple(g for g in GUARANTEES if g not in CGROUP_GUARANTEES),
    "userns": tuple(g for g in GUARANTEES if g != "uid" and g not in CGROUP_GUARANTEES),
    # root without namespaces (Docker's default profile: Gradescope, Kubernetes, CI runners): a fresh uid, the
    # learner's filter, and the files a box must not reach made private to root first (``lockdown``)
    "container": ("files", "processes", "uid", "system calls", "keyring"),
    "plain": ("system calls", "keyring"),
}
MODES = tuple(HOLDS)  # strongest first
ALLOW_PLAIN = "--allow-plain"  # how an instructor opts into plain confinement (the refusal names it)


class ConfinementRecord(TypedDict):
    """A confinement as a grading record states it (``Confinement.record()``)."""
    mode: str
    missing: list[str]


@dataclass(frozen=True)
class Confinement:
    """Which confinement a sandbox runs with, and what it lacks of the strongest."""

    mode: str
    cgroup: bool = False  # a cgroup for each box, counting its CPU time
    bounded: bool = False  # ... bounding its memory and number of processes too
    why: str = ""  # why stronger confinements failed, if they did
    private: tuple = ()  # what was made private to root before any box started (container)

    @property
    def missing(self) -> list[str]:
        cgroups = dict(zip(CGROUP_GUARANTEES, (self.cgroup, self.bounded)))
        holds = set(HOLDS[self.mode]) | {g for g, held in cgroups.items() if held}
        return [g for g in GUARANTEES if g not in holds]

    def summary(self) -> str:
        if self.mode == "plain":
            head = ("sandbox: plain (UNCONFINED, as the instructor allowed): learner code runs as this user, beside "
                    "the grader, and can read the solutions and hidden tests; it lacks")
        elif not self.missing:
            return f"sandbox: {self.mode} (fresh namespaces, /tmp, uid and cgroup for each submission)"
        else:
            head = f"sandbox: {self.mode}, WEAKER than full confinement; it lacks"
        lacking = "; ".join(GUARANTEES[g] for g in self.missing)
        private = f" (made private to root first: {', '.join(self.private)})" if self.private else ""
        return f"{head} {lacking}{private}" + (f" [{self.why}]" if self.why else "")

    def record(self) -> ConfinementRecord:
        return {"mode": self.mode, "missing": self.missing}


class SandboxWarning(UserWarning):
    """The sandbox runs with weaker confinement than it would like."""


class SandboxUnavailable(RuntimeError):
    """No way to start a template or a box works on this machine (not the learner's fault)."""


class ConfinementRefused(SandboxUnavailable, AttnkitError):
    """No confinement holds here, and the instructor did not allow grading without one."""

def candidate_modes(allow_plain: bool = False) -> list[str]:
    """Confinements worth trying here, strongest first. Never ``userns`` as root: the boxes would
    keep root's uid on the host (owner of its files, its sysctls) without a capability to lose. Root
    whose namespaces are refused (a container) gets ``container``. ``plain`` only when allowed."""
    modes = []
    if os.geteuid() == 0:
        modes += ["namespaces"] if shutil.which("unshare") else []
        modes.append("container")
    elif shutil.which("unshare"):
        modes.append("userns")
    return modes + (["plain"] if allow_plain else [])


def refuse(mode):
    if mode == "userns" and os.geteuid() == 0:
        raise SandboxUnavailable("userns: refused as root (the boxes would keep root's uid on the host); "
                                 "root gets the namespaces confinement")
    if mode == "container" and os.geteuid() != 0:
        raise SandboxUnavailable("container: needs root (each box gets a fresh uid)")
    if mode == "container" and platform.machine() not in AUDIT_ARCH:
        raise SandboxUnavailable(f"container: no system call table for {platform.machine()} (x86_64, aarch64)")
    if mode not in HOLDS:
        raise SandboxUnavailable(f"{mode!r} is not a confinement ({', '.join(MODES)})")


def refusal(failures: list[str]) -> ConfinementRefused:
    """The error of a machine where no confinement holds: what failed, and what to do."""
    return ConfinementRefused(
        "no confinement for learner code holds on this machine, so nothing was graded: "
        + "; ".join(failures) + ". Grade as root (with namespaces, or in a container with Docker's default "
        "capabilities), or where unprivileged user namespaces are enabled (sysctl kernel.unprivileged_userns_clone=1"
        f"). To grade anyway with learner code UNCONFINED beside the grader (it can then read the solutions and "
        f"hidden tests), pass {ALLOW_PLAIN} (attnkit grade, attnkit gradescope, attnkit course build)")


def unshare_command(mode) -> list[str]:
    """The command prefix that puts a template in its namespaces ([] for container and plain)."""
    if mode in ("container", "plain"):
        return []
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    return [shutil.which("unshare") or "unshare", *user, "--mount", "--pid", "--net", "--ipc", "--uts",
            "--fork", "--kill-child", "--"]


def container_holds() -> str | None:
    """Why the container confinement cannot work here (None: it can): it needs root's power to change uids
    and a kernel with seccomp filters."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        effective = int(fields["CapEff"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return "cannot read this process's capabilities (/proc/self/status)"
    capabilities = (("CAP_SETUID", 7), ("CAP_SETGID", 6), ("CAP_KILL", 5))
    lacking = [name for name, bit in capabilities if not effective >> bit & 1]
    if lacking:
        return f"root without {', '.join(lacking)}"
    if "Seccomp" not in fields:
        return "the kernel has no seccomp filters"
    return None


def probe(confine=None, allow_plain=False) -> Confinement:
    """The strongest confinement this machine allows, found quickly (no template is started): what a
    grading run announces before it starts. Raises ConfinementRefused where none holds and plain is not
    allowed."""
    failures = []
    for mode in [confine] if confine else candidate_modes(allow_plain):
        refuse(mode)
        if mode == "container":
            why = container_holds()
            if why:
                failures.append(f"container: {why}")
                continue
        elif mode != "plain":
            try:
                run = subprocess.run([*unshare_command(mode), "true"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                failures.append(f"{mode}: {exc}")
                continue
            if run.returncode != 0:
                failures.append(f"{mode}: {run.stderr.strip() or run.returncode}")
                continue
        return Confinement(mode, *cgroup_support(), why="; ".join(failures))
    raise refusal(failures or ["no confinement was allowed"])


def cgroup_support() -> tuple[bool, bool]:
    """Whether this process may give each box a cgroup: (its CPU time counted, its memory and number
    of processes bounded)."""
    group = BoxGroup.create(1 << 30, 1)
    if group is None:
        return False, False
    bounded = {"memory", "pids"} <= set(group.folders)
    group.remove()
    return True, bounded
