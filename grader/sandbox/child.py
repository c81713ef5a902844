"""The confined side of the sandbox (``grader.sandbox.template``), and its first process: the template.

The grader copies this file and its siblings (the ``RUNTIME_MODULES`` of ``template``: ``syscalls``, ``seccomp``,
``box_process``, ``worker_process``, ``reference_proxy``, ``reference_process``, ``wire``, ``procfs``) with the
suite's ``adapters.py`` and ``stage_names.py`` into a private folder and runs ``python -I child.py CONFIG`` there.
Four kinds of process come out of it, each in a module of its own:

template   (this module) One per grading process; it never runs learner code. It confines itself: in a fresh
           mount namespace it builds a root file system that holds only the operating system, the Python
           installation with every folder of the grader's ``sys.path`` the imports need, and the kit's runtime
           (these files), and pivots into it. Then it imports NumPy, torch and the adapter once and waits on its
           control socket, which only the grader holds, for two requests: "spawn" a box, "kill" a box.
box        (``box_process``) One per submission (a fresh one after a crash or a time-out), forked from the
           template as the first process of a fresh pid namespace. It confines the box (namespaces, /proc, /tmp,
           keyring, limits, uid) and forks workers; it never runs learner code either.
worker     (``worker_process``) Loads the learner's filter (``seccomp``), imports the learner's module of a
           stage beside proxies of the stages it builds on (``reference_proxy``), answers the operations on it.
reference  (``reference_process``) A box of its own per submission whose first process runs the reference of
           the stages a stage builds on, for those proxies: it never runs learner code, and learner code never
           holds the reference's code.

When a submission is done, or its box misbehaves, the grader asks the template
to kill the box: killing the pid namespace's first process makes the kernel kill
every process of the box, and its mounts, IPC objects, sockets and keyring go
with the namespaces. No process that ran learner code ever serves another
submission, and whatever a box says is data about its own submission only
(the wire format: ``wire``).

Every module of the confined side imports nothing but the standard library and its siblings at the top, so that
the bootstrap can run before the sandbox exists; NumPy and torch are imported lazily.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time

if __package__:  # the trusted side reads this module as grader.sandbox.child
    from . import box_process
    from .procfs import children, processes_of
    from .syscalls import (
        CLONE_NEWPID,
        DEVICES,
        MNT_DETACH,
        MS_BIND,
        MS_NODEV,
        MS_NOEXEC,
        MS_NOSUID,
        MS_RDONLY,
        MS_REMOUNT,
        PR_SET_CHILD_SUBREAPER,
        PR_SET_PDEATHSIG,
        SYSTEM_DIRS,
        bind,
        check,
        inside,
        libc,
        mount,
        syscall,
        tmpfs,
        warn,
    )
    from .wire import CONTROL_BYTES
else:  # run from the box's runtime folder (python -I: no folder of its own on the path), beside its siblings
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import box_process
    from procfs import children, processes_of
    from syscalls import (
        CLONE_NEWPID,
        DEVICES,
        MNT_DETACH,
        MS_BIND,
        MS_NODEV,
        MS_NOEXEC,
        MS_NOSUID,
        MS_RDONLY,
        MS_REMOUNT,
        PR_SET_CHILD_SUBREAPER,
        PR_SET_PDEATHSIG,
        SYSTEM_DIRS,
        bind,
        check,
        inside,
        libc,
        mount,
        syscall,
        tmpfs,
        warn,
    )
    from wire import CONTROL_BYTES

    del sys.path[0]

KILL_SECONDS = 5.0  # a box's uid must have no process left within this
Boxes = dict  # token -> (pid of the box's first process, its uid)


def exposable(path: str, config: dict) -> bool:
    """Whether ``path`` (a folder of ``sys.path``) may be shown to boxes: it holds no secret (the kit, its
    solutions, tests and fixtures, the course being graded) and lies inside none of what is hidden (the kit's
    private folders, the course; a venv inside the kit's folder is not one of them)."""
    return not any(inside(secret, path) for secret in config["secrets"]) and not any(
        inside(path, hidden) for hidden in config.get("hidden", []))


def import_path(config: dict) -> tuple[list[str], list[str]]:
    """The folders boxes import from, in the grader's order: the entries of its ``sys.path`` that hold what boxes
    import (``config["path"]``, ``lockdown.import_folders``: a user site-packages folder or a .pth folder outside
    the installation, which ``python -I`` leaves out, included) and may be shown (``exposable``), then this
    interpreter's own that lie inside the Python installation; and the entries left out because they hold or
    lie inside a secret."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    own = [p for p in sys.path if p and any(inside(p, prefix) for prefix in prefixes)]
    kept, left_out = [], []
    for entry in dict.fromkeys(p for p in [*config.get("path", []), *own] if os.path.isabs(p)):
        if not os.path.exists(entry):
            continue
        if exposable(entry, config) and exposable(os.path.realpath(entry), config):
            kept.append(entry)
        else:
            left_out.append(entry)
    return kept, left_out


# ---------------------------------------------------------------- the root file system

def build_root(lib: ctypes.CDLL, config: dict, path: list[str]) -> list[str]:
    """Make ``config['newroot']`` a root file system with only what Python needs, and enter it.

    What Python needs: the system's folders, the Python installation (its prefixes) and the folders of
    ``path`` (``import_path``), read-only, each at the path it has here (a symbolic link to its real path where
    it is reached through one). Runs as root of the new mount namespace that ``unshare`` created (its mounts
    are private: nothing done here is visible outside). Returns the paths placed under /tmp (a Python
    installation that lives there): each box puts them back on its own /tmp.
    """
    new = config["newroot"]

    def expose(folder, readonly=True):
        for secret in config["secrets"]:
            if inside(secret, folder):
                raise RuntimeError(f"{folder} contains {secret}: the sandbox cannot hide it")
        bind(lib, folder, new + folder, readonly)

    tmpfs(lib, new, 1 << 20, mode="755")
    # /tmp comes first: a Python installation under /tmp (a venv in a clone under /tmp) is
    # then bound inside it instead of being hidden by it.
    tmpfs(lib, new + "/tmp", 1 << 20)
    exposed = []
    for folder in SYSTEM_DIRS:
        if os.path.islink(folder):
            os.symlink(os.readlink(folder), new + folder)
        elif os.path.isdir(folder):
            expose(folder)
            exposed.append(folder)
    # The Python installation and the folders it imports from, at the same absolute paths (the venv's interpreter
    # is a symlink into the base installation, which may sit under /root's 0700 home).
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    for folder in sorted({os.path.realpath(p) for p in [*prefixes, *path]}):
        if not any(inside(folder, done) for done in exposed):
            expose(folder)
            exposed.append(folder)
    for folder in [*prefixes, *path]:  # a folder reached through a symlink keeps working
        if os.path.normpath(folder) != os.path.realpath(folder) and not os.path.lexists(new + folder):
            os.makedirs(os.path.dirname(new + folder), exist_ok=True)
            os.symlink(os.path.realpath(folder), new + folder)
            exposed.append(os.path.normpath(folder))
    # The kit's runtime and the folder the grader fills with each box's submission.
    bind(lib, config["runtime_host"], new + "/sandbox/runtime")
    bind(lib, config["incoming_host"], new + "/sandbox/incoming")
    os.makedirs(new + "/sandbox/submission")  # each box binds its own submission here
    # /dev: a few harmless devices (each box gets its own /dev/shm).
    os.makedirs(new + "/dev")
    tmpfs(lib, new + "/dev", 64 << 10, mode="755", flags=MS_NOSUID | MS_NOEXEC)
    for name in DEVICES:
        bind(lib, "/dev/" + name, f"{new}/dev/{name}", readonly=False)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    mount(lib, None, new + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    # The template's /proc (each box mounts its own over it; inside a user namespace the kernel
    # allows that only where a proc is mounted already). A convenience: a container may refuse.
    os.makedirs(new + "/proc")
    try:
        mount(lib, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        warn(f"no /proc in the sandbox ({exc})")
    try:
        bind(lib, "/sys", new + "/sys")  # read-only; torch reads the CPU layout there
    except OSError as exc:
        warn(f"no /sys in the sandbox ({exc})")
    # Enter the new root; the old one is detached, so nothing outside stays reachable.
    os.chdir(new)
    check(syscall(lib, "pivot_root", b".", b"."), "pivot_root")
    check(lib.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(lib, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return [p for p in exposed if inside(p, "/tmp")]


def writable_shared_memory() -> list[str]:
    """Writable shared mappings of this process: a box forked from it would share them."""
    try:
        with open("/proc/self/maps") as maps:
            return [line.split(None, 5)[-1].strip() for line in maps if line.split()[1][1:4:2] == "ws"]
    except OSError:
        return []


# ---------------------------------------------------------------- the template

def main() -> int:
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=config["control_fd"])
    confined = bool(config["newroot"])
    path, left_out = import_path(config)
    try:
        lib = libc()
        under_tmp = build_root(lib, config, path) if confined else []
        if not confined:
            # What a box leaves behind (a daemon whose parent died) becomes ours to kill.
            lib.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.chdir("/")
        sys.path[:] = path
        try:
            import numpy.random
            import torch
        except ImportError as exc:
            hint = (f" (left out of the sandbox, since they hold or lie inside what boxes must not reach: "
                    f"{', '.join(left_out)}; install the packages elsewhere)") if left_out else ""
            raise ImportError(f"{exc}{hint}") from None

        torch.set_num_threads(1)  # (the environment says so too: see ONE_THREAD in grader/sandbox/limits.py)
        sys.path.insert(0, config["runtime"])
        from suite_runtime import adapters  # noqa: F401

        warm_up(torch, numpy)
        shared = writable_shared_memory()
        if shared:
            raise RuntimeError(f"the template holds writable shared memory ({shared[0]}), which boxes would share")
    except BaseException as exc:
        send(control, {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    own_pids = os.open("/proc/self/ns/pid", os.O_RDONLY) if confined else None  # see spawn()
    send(control, {"kind": "ready", "pid": os.getpid(), "path": path, "left_out": left_out})
    boxes: Boxes = {}
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, CONTROL_BYTES, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            break  # the grader closed the socket (or died)
        try:
            request = json.loads(data)
        except ValueError:
            request = {}
        token = str(request.get("token", ""))
        if request.get("cmd") == "spawn" and len(fds) == 4 and token not in boxes:
            pid = spawn(lib, config, request, fds, under_tmp, own_pids)
            boxes[token] = (pid, request.get("uid"))
            reply = {"kind": "spawned", "token": token, "pid": pid}
        elif request.get("cmd") == "kill":
            gone = kill_box(*boxes.pop(token), config) if token in boxes else True
            reply = {"kind": "gone" if gone else "failed", "token": token,
                     "message": "" if gone else "processes of the box's uid outlived it"}
        else:
            reply = {"kind": "error", "message": f"bad request {request.get('cmd')!r}"}
        for fd in fds:
            os.close(fd)
        reap_strays(boxes)
        send(control, reply)
    for pid, uid in boxes.values():
        kill_box(pid, uid, config)
    os._exit(0)  # (no interpreter teardown: torch's takes most of a second)


def send(control: socket.socket, message: dict) -> None:
    control.send(json.dumps(message).encode())


def spawn(lib: ctypes.CDLL, config: dict, request: dict, fds: list[int], under_tmp: list[str],
          own_pids: int | None) -> int:
    """Fork the first process of a new box (confined: the init of a new pid namespace); returns its
    pid. Its other namespaces it makes itself (see box_process.box_main)."""
    if own_pids is not None:
        check(lib.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the next child only
    try:
        pid = os.fork()
        if pid == 0:
            box_process.box_main(lib, config, request, fds, under_tmp)  # never returns
    finally:
        if own_pids is not None:  # the template's later children are its own pid namespace's again
            check(lib.setns(own_pids, CLONE_NEWPID), "setns(CLONE_NEWPID)")
    return pid


def kill_box(init: int, uid: int | None, config: dict) -> bool:
    """Kill one box and wait until it is gone; False if a process of its uid could not be killed.

    Confined, the box's first process is the init of its pid namespace: killing it makes the
    kernel kill every other process of the box, and it can be reaped once the namespace is
    empty. In a container (no pid namespace), every process of the box's uid is killed by a process
    of that uid (``kill_uid``): the box's world is its uid. Otherwise (plain) every process of the
    box's tree is killed (what escaped it, an orphan reparented to this template, by ``reap_strays``).
    """
    if config["mode"] == "container":
        return kill_uid(uid, init)
    confined = bool(config["newroot"])
    doomed, pending = [init], [] if confined else [init]
    while pending:
        more = children(pending.pop())
        doomed += more
        pending += more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(init, 0)
    except ChildProcessError:
        pass
    return True


def kill_uid(uid: int, init: int) -> bool:
    """Kill every process of ``uid`` (and reap those that were ours), then check with /proc that none is
    left. The kernel lets a process of the uid signal all the others (kill(-1)), and with the learner's
    filter they cannot start new ones, so the killing is not a race."""
    deadline = time.monotonic() + KILL_SECONDS
    while True:
        killer = os.fork()
        if killer == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                for _ in range(3):
                    os.kill(-1, signal.SIGKILL)  # every process this uid may signal, but itself
            except ProcessLookupError:
                pass
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(init, 0)
        reap_dead()  # (only the dead: the template's other boxes, a reference process among them, live on)
        if not processes_of(uid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def reap_strays(boxes: Boxes) -> None:
    """Kill and reap children of the template that are no box's first process: what a box left
    behind without namespaces (reparented here, the subreaper)."""
    inits = {pid for pid, _ in boxes.values()}
    for pid in children(os.getpid()):
        if pid not in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    reap_dead()


def reap_dead() -> None:
    """Reap the template's children that have ended."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def warm_up(torch, np) -> None:
    """Run torch's usual module paths once here, so that every forked worker finds them initialised
    (lazy set-up done once per template, not once per stage). Leaves torch's random state as it
    was: a worker starts from the state of a freshly imported torch, as in a fresh process."""
    state = torch.get_rng_state()
    try:
        for bias in (False, True):
            linear = torch.nn.Linear(4, 4, bias=bias)
            model = torch.nn.Sequential(linear, torch.nn.Dropout(0.5), torch.nn.ModuleList([torch.nn.Linear(4, 2)])[0])
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=False)
            model.register_buffer("mask", torch.triu(torch.ones(3, 3), diagonal=1))
            x = torch.from_numpy(np.array(np.ones((2, 3, 4), np.float32)))
            for train in (True, False):
                model.train(train)
                with torch.no_grad():
                    q = linear(x)
                    s = (q @ q.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(model.mask.bool()[:3, :3], -torch.inf)
                    out = (torch.softmax(s, dim=-1) @ q).view(2, 3, 2, 2).transpose(1, 2).contiguous().reshape(2, 3, 4)
                    torch.cat([out, out], dim=-1)
                    model(x).detach().cpu().float().numpy()
            model.to(device="cpu", dtype=torch.bfloat16)(x.to(torch.bfloat16)).detach().float().numpy()
            list(model.named_parameters(remove_duplicate=False))
            list(model.named_buffers())
            list(model.named_modules())
    except Exception:
        pass  # only a head start: the workers do the same work anyway
    finally:
        torch.set_rng_state(state)


if __name__ == "__main__":
    sys.exit(main())
