"""A cgroup for each box: what the kernel counts and bounds for all of a submission's processes.

Reading /proc cannot see everything a box does: a process whose parent ignores SIGCHLD is reaped
by the kernel without its CPU time being added to anyone's, and a box may spread its work over
many short-lived processes. A cgroup counts the CPU time of every process that ever ran in it,
and bounds their memory and number together. The grader puts a box's first process into a new
cgroup before any learner code runs; whatever the box starts stays in it (moving out needs a
write to a root-owned file).

Each controller is taken from whichever hierarchy has it, cgroup v2 (unified) or v1:

- CPU time: v2 ``cpu.stat`` (every v2 cgroup has it), else v1 ``cpuacct.usage``;
- time spent waiting for a processor: v2 ``cpu.pressure`` (where the kernel has pressure stall
  information), so that waiting limits do not charge a loaded machine's delays to the learner;
- memory: v2 ``memory.max`` or v1 ``memory.limit_in_bytes`` (the box's processes together);
- processes: v2 or v1 ``pids.max``;
- a fair share of the processors for the box as a whole: being a cgroup of its own (v2 ``cpu``
  or v1 ``cpu``) rather than one scheduling group per session it starts.

Only the CPU time is needed for the time limits to hold (``BoxGroup.create`` makes no group
without it); the others are used where this process may create cgroups (root, or a delegated subtree).
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

PREFIX = "attnkit-box-"  # then the pid of the grading process that made it
V2_CONTROLLER = {"memory": "memory", "pids": "pids", "share": "cpu"}


def _mounts() -> dict[str, Path]:
    """controller (or "unified") -> the cgroup folder of this process in that hierarchy."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    roots = {}  # hierarchy key -> mount point
    for line in mountinfo:
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        if fstype == "cgroup2":
            roots.setdefault("unified", fields[4])
        elif fstype == "cgroup":
            for option in options:
                if option in ("cpu", "cpuacct", "memory", "pids"):
                    roots.setdefault(option, fields[4])
    folders = {}
    for line in memberships:
        number, controllers, path = line.split(":", 2)
        for key in (["unified"] if number == "0" else controllers.split(",")):
            if key in roots:
                folders[key] = Path(roots[key] + path.rstrip("/"))
    return folders


class BoxGroup:
    """The cgroups of one box (one folder per hierarchy used); ``create`` returns None when this
    process may not make any (then the grader falls back on /proc)."""

    def __init__(self, folders: dict[str, Path]):
        self.folders = folders  # role -> folder: "cpu" (CPU time), "memory", "pids", "share"
        self._usage = None  # the open CPU-time file (read often: kept open, read with pread)
        self._pressure = None  # the open cpu.pressure file; -1 where there is none

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> BoxGroup | None:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        parents = _mounts()
        folders = {}
        for role, keys in (("cpu", ("unified", "cpuacct")), ("memory", ("unified", "memory")),
                           ("pids", ("unified", "pids")), ("share", ("unified", "cpu"))):
            for key in keys:
                parent = parents.get(key)
                if parent is None or (key == "unified" and role != "cpu" and not _enabled(parent, V2_CONTROLLER[role])):
                    continue
                folder = parent / name
                try:
                    folder.mkdir(exist_ok=True)
                except OSError:
                    continue
                folders[role] = folder
                break
        if "cpu" not in folders:
            cls(folders).remove()
            return None
        group = cls(folders)
        group._write("memory", {"memory.max": memory_bytes, "memory.limit_in_bytes": memory_bytes})
        group._write("pids", {"pids.max": processes})
        return group

    def _write(self, role, settings):
        folder = self.folders.get(role)
        if folder is None:
            return
        for name, value in settings.items():
            if (folder / name).exists():
                try:
                    (folder / name).write_text(str(value))
                except OSError:
                    pass

    def add(self, pid: int) -> bool:
        """Move process ``pid`` (the box's first, before it starts anything) into every cgroup."""
        done = True
        for folder in set(self.folders.values()):
            try:
                (folder / "cgroup.procs").write_text(str(pid))
            except OSError:
                done = False
        return done

    def cpu_seconds(self) -> float | None:
        """CPU time of every process that ran in the box, dead ones included."""
        try:
            if self._usage is None:
                folder = self.folders["cpu"]
                v2 = (folder / "cpu.stat").exists()
                self._usage = (v2, os.open(folder / ("cpu.stat" if v2 else "cpuacct.usage"), os.O_RDONLY))
            v2, fd = self._usage
            text = os.pread(fd, 4096, 0).decode()
            if v2:
                return int(text.split("usage_usec ", 1)[1].split(None, 1)[0]) / 1e6
            return int(text) / 1e9
        except (OSError, ValueError, IndexError, KeyError):
            return None

    def stalled_seconds(self) -> float | None:
        """How long the box's processes were ready to run but waited for a processor (v2
        ``cpu.pressure``, its "some" total): the machine's load, not the learner's doing. None where
        the kernel does not report it (v1, or no pressure stall information)."""
        try:
            if self._pressure is None:
                try:
                    self._pressure = os.open(self.folders["cpu"] / "cpu.pressure", os.O_RDONLY)
                except OSError:
                    self._pressure = -1
            if self._pressure < 0:
                return None
            text = os.pread(self._pressure, 4096, 0).decode()  # "some avg10=... total=<microseconds>\n..."
            return int(text.split("total=", 1)[1].split(None, 1)[0]) / 1e6
        except (OSError, ValueError, IndexError, KeyError):
            return None

    def remove(self):
        """Remove the cgroups once their processes are gone (the box is killed first)."""
        if self._usage is not None:
            os.close(self._usage[1])
            self._usage = None
        if self._pressure is not None and self._pressure >= 0:
            os.close(self._pressure)
        self._pressure = None
        for folder in set(self.folders.values()):
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # the last process is still being taken down


def _enabled(parent: Path, controller: str) -> bool:
    """Whether cgroup v2 gives the children of ``parent`` this controller."""
    try:
        return controller in (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def sweep():
    """Remove the box cgroups that dead grading processes left behind (killed runs)."""
    for parent in set(_mounts().values()):
        try:
            entries = [p for p in parent.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
        except OSError:
            continue
        for folder in entries:
            owner = folder.name[len(PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not _alive(int(owner)):
                try:
                    folder.rmdir()  # an empty cgroup only: a box still running keeps its own
                except OSError:
                    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
