"""The child side of ``grader.sandbox``, and the wire format both sides share.

The grader copies this file and ``tests/adapters.py`` into a private work
directory and runs ``python -I sandbox_child.py CONFIG`` there. The child:

1. confines itself (see ``confine``): in a fresh mount namespace it builds a
   new root file system that holds only the operating system, the Python
   installation and the work directory, pivots into it, and gives up every
   privilege (a dedicated unprivileged uid, or a nested user namespace);
2. sets resource limits, imports NumPy and torch once (the "zygote");
3. forks a *worker*, which imports the learner's module of each stage afresh
   and answers operations until told to close the stage; it serves the next
   stage only if the last left no trace (see ``serve``), else the zygote forks
   a fresh one. Learner code only ever runs in a worker, so a crash costs one
   stage and the zygote stays clean;
4. on ``reset`` (between two submissions, when the grader reuses a warm
   zygote) empties its scratch space (/tmp, /dev/shm).

Wire format (both directions): an 8-byte little-endian length, a JSON header,
then the binary blobs the header lists. Arrays travel as ``.npy`` blobs
written and read with ``allow_pickle=False``; nothing is ever unpickled.
Only the grader's parent process decides what a result means.

This module imports nothing but the standard library at the top so that the
bootstrap can run before the sandbox exists; NumPy is imported lazily.
"""
from __future__ import annotations

import io
import json
import os
import re
import struct
import sys

LENGTH = struct.Struct("<Q")
MAX_DEPTH = 64  # nesting of lists/tuples/dicts in one message
MAX_DIMS = 32
RAW_DTYPE = re.compile(r"^[<>|=]?[biufc]\d{1,2}$")  # plain numeric or bool dtypes, e.g. <f4, |b1


class ProtocolError(Exception):
    """A message that does not follow the wire format (or breaks its limits)."""


# ---------------------------------------------------------------- encoding

def encode(value, blobs, depth=0):
    """Turn a plain value into JSON-able data; arrays go to ``blobs`` as .npy bytes."""
    import numpy as np

    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind in "biufc" and not array.dtype.hasobject:
            # Raw bytes with dtype and shape in the header: cheaper than .npy for the small
            # arrays the tests exchange, and just as free of pickle.
            # Memory order as .npy keeps it: Fortran order for an F- but not C-contiguous array.
            fortran = bool(array.flags.f_contiguous and not array.flags.c_contiguous)
            blobs.append((array.T if fortran else array).tobytes())
            if isinstance(value, np.ndarray):
                return {"__raw__": [len(blobs) - 1, array.dtype.str, list(array.shape), fortran]}
            return {"__rawscalar__": [len(blobs) - 1, array.dtype.str]}
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(value), allow_pickle=False)
        blobs.append(buffer.getvalue())
        key = "__array__" if isinstance(value, np.ndarray) else "__scalar__"
        return {key: len(blobs) - 1}
    if isinstance(value, list):
        return [encode(v, blobs, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, blobs, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, blobs, depth + 1), encode(v, blobs, depth + 1)] for k, v in value.items()]}
    raise ProtocolError(f"cannot send a {type(value).__module__}.{type(value).__name__}")


def decode(data, blobs, depth=0):
    """The inverse of ``encode``, checking every node: what comes back is plain data only."""
    import numpy as np

    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, blobs, depth + 1) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ProtocolError("malformed value")
    (tag, inner), = data.items()
    if tag in ("__raw__", "__rawscalar__"):
        return _raw_array(tag, inner, blobs)
    if tag in ("__array__", "__scalar__"):
        if type(inner) is not int or not 0 <= inner < len(blobs):
            raise ProtocolError("bad array reference")
        try:
            array = np.lib.format.read_array(io.BytesIO(blobs[inner]), allow_pickle=False)
        except Exception as exc:  # truncated data, object dtype, bad header...
            raise ProtocolError(f"unreadable array: {exc}") from None
        if array.dtype.kind not in "biufc" or array.dtype.hasobject:
            raise ProtocolError(f"arrays must be numeric or bool, not {array.dtype}")
        return array[()] if tag == "__scalar__" else array
    if tag == "__tuple__" and isinstance(inner, list):
        return tuple(decode(v, blobs, depth + 1) for v in inner)
    if tag == "__dict__" and isinstance(inner, list):
        result = {}
        for pair in inner:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError("malformed dict entry")
            key = decode(pair[0], blobs, depth + 1)
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise ProtocolError("dict keys must be strings or numbers")
            result[key] = decode(pair[1], blobs, depth + 1)
        return result
    raise ProtocolError(f"unknown tag {tag!r}")


def _raw_array(tag, inner, blobs):
    """A "__raw__" array (or "__rawscalar__"): blob index, dtype string and shape, all checked."""
    import numpy as np

    size = 4 if tag == "__raw__" else 2
    if not isinstance(inner, list) or len(inner) != size:
        raise ProtocolError("malformed array")
    index, dtype = inner[0], inner[1]
    shape, fortran = (inner[2], inner[3]) if tag == "__raw__" else ([], False)
    if type(fortran) is not bool:
        raise ProtocolError("malformed array")
    if type(index) is not int or not 0 <= index < len(blobs):
        raise ProtocolError("bad array reference")
    if not isinstance(dtype, str) or not RAW_DTYPE.match(dtype):
        raise ProtocolError("arrays must be numeric or bool")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape):
        raise ProtocolError("bad array shape")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ProtocolError("bad array dtype") from None
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise ProtocolError(f"arrays must be numeric or bool, not {dtype}")
    data = blobs[index]
    count = 1
    for n in shape:
        count *= n
    if count * dtype.itemsize != len(data):
        raise ProtocolError(f"unreadable array: {len(data)} bytes for shape {shape} of {dtype}")
    array = np.frombuffer(data, dtype=dtype, count=count)
    array = array.reshape(shape[::-1]).T.copy(order="F") if fortran else array.reshape(shape).copy()
    return array[()] if tag == "__rawscalar__" else array


def pack(header, blobs=()):
    """One message as bytes: length, JSON header (with the blob sizes), blobs."""
    header = dict(header, blobs=[len(b) for b in blobs])
    text = json.dumps(header).encode()
    return b"".join([LENGTH.pack(len(text)), text, *blobs])


def write_message(fd, header, blobs=()):
    data = memoryview(pack(header, blobs))
    while data:
        data = data[os.write(fd, data):]


def read_exactly(fd, size):
    """Blocking read of ``size`` bytes (child side); None at end of file."""
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_message(fd):
    """The child's reader: requests come from the trusted parent. None at end of file."""
    raw = read_exactly(fd, LENGTH.size)
    if raw is None:
        return None
    header = json.loads(read_exactly(fd, LENGTH.unpack(raw)[0]))
    blobs = [read_exactly(fd, n) for n in header.pop("blobs")]
    return header, blobs


# ---------------------------------------------------------------- confinement (Linux)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (glibc has no wrapper)
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
DEVICES = ["null", "zero", "full", "random", "urandom"]


def libc():
    import ctypes

    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def check(result, what):
    if result != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(lib, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else str(s).encode()
    check(lib.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def bind(lib, source, target, readonly=True):
    """Bind ``source`` (a directory or a device file) at ``target``, read-only by default."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(lib, source, target, None, MS_BIND | MS_REC)
    if readonly:
        # A read-only remount must keep the flags the source mount already has (the
        # kernel refuses to clear them inside a user namespace).
        st = os.statvfs(source)
        keep = (st.f_flag & os.ST_NOSUID and MS_NOSUID) | (st.f_flag & os.ST_NODEV and MS_NODEV) | (
            st.f_flag & os.ST_NOEXEC and MS_NOEXEC)
        mount(lib, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def inside(path, parent):
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def scratch(lib, config, new, path):
    """A small private tmpfs at ``path`` that the learner may write to."""
    os.makedirs(new + path, exist_ok=True)
    mount(lib, "tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['tmp_bytes']},mode=1777")


def build_root(lib, config):
    """Make ``config['newroot']`` a root file system with only what Python needs, and enter it.

    Runs as root of the new mount namespace that ``unshare`` created (its mounts are
    private: nothing done here is visible outside).
    """
    new = config["newroot"]

    def expose(path, readonly=True):
        for secret in config["secrets"]:
            if inside(secret, path):
                raise RuntimeError(f"{path} contains {secret}: the sandbox cannot hide it")
        bind(lib, path, new + path, readonly)

    mount(lib, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    # The private /tmp comes first: a Python installation that lives under /tmp (a venv in a
    # clone under /tmp) is then bound inside it instead of being hidden by it.
    scratch(lib, config, new, "/tmp")
    exposed = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), new + path)
        elif os.path.isdir(path):
            expose(path)
            exposed.append(path)
    # The Python installation, at the same absolute paths (the venv's interpreter is a
    # symlink into the base installation, which may sit under /root's 0700 home).
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    for prefix in sorted({os.path.realpath(p) for p in prefixes}):
        if not any(inside(prefix, done) for done in exposed):
            expose(prefix)
            exposed.append(prefix)
    for prefix in prefixes:  # a prefix reached through a symlink keeps working
        if os.path.normpath(prefix) != os.path.realpath(prefix) and not os.path.lexists(new + prefix):
            os.makedirs(os.path.dirname(new + prefix), exist_ok=True)
            os.symlink(os.path.realpath(prefix), new + prefix)
    bind(lib, config["box"], new + "/sandbox")
    # /dev: a few harmless devices; /tmp and /dev/shm: small private tmpfs.
    os.makedirs(new + "/dev")
    mount(lib, "tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        bind(lib, "/dev/" + name, f"{new}/dev/{name}", readonly=False)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"{new}/dev/{name}")
    scratch(lib, config, new, "/dev/shm")
    # /proc of the new pid namespace, /sys read-only (torch reads the CPU layout there).
    # Both are conveniences: a container may refuse them, and Python runs without.
    os.makedirs(new + "/proc")
    try:
        mount(lib, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        warn(f"no /proc in the sandbox ({exc})")
    try:
        bind(lib, "/sys", new + "/sys")
    except OSError as exc:
        warn(f"no /sys in the sandbox ({exc})")
    # Enter the new root; the old one is detached, so nothing outside stays reachable.
    machine = os.uname().machine
    if machine not in PIVOT_ROOT:
        raise RuntimeError(f"pivot_root: unknown syscall number on {machine}")
    os.chdir(new)
    check(lib.syscall(PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    check(lib.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(lib, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(lib, config):
    """Give up root for good: a dedicated uid, or a nested user namespace that owns nothing."""
    if config["drop"] == "uid":
        uid = config["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root to non-zero: every capability is gone
    elif config["drop"] == "userns":
        # We are "root" of a user namespace that owns our mounts. A nested user
        # namespace owns none of them, so the mounts can no longer be undone.
        check(lib.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # Changing credentials cleared the parent-death signal; ask for it again.
    check(lib.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "pdeathsig")


def set_limits(config):
    import resource

    limits = {
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_FSIZE: config["tmp_bytes"],
    }
    if config.get("processes"):
        limits[resource.RLIMIT_NPROC] = config["processes"]
    for which, value in limits.items():
        if value is not None:
            resource.setrlimit(which, (value, value))


def warn(text):
    sys.stderr.write(f"[sandbox] {text}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- zygote and workers

def main():
    config = json.loads(sys.argv[1])
    requests, replies = config["requests_fd"], config["replies_fd"]
    try:
        lib = libc()
        if config["newroot"]:
            build_root(lib, config)
        set_limits(config)
        if config["drop"]:
            drop_privileges(lib, config)
        else:
            lib.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        os.chdir(config["tmp"])
        import numpy.random  # noqa: F401  (imported once here, shared by every worker)
        import torch

        torch.set_num_threads(config["threads"])
        sys.path.insert(0, config["runtime"])
        import adapters

        if config["threads"] == 1:  # (with more, an OpenMP pool started here would not survive the fork)
            warm_up(torch, numpy)
    except BaseException as exc:
        write_message(replies, {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    write_message(replies, {"kind": "ready", "uid": os.getuid(), "pid": os.getpid()})
    while True:
        message = read_message(requests)
        if message is None:
            return 0  # the grader closed the pipe (or died)
        header, _ = message
        if header.get("cmd") == "reset":
            # Between two submissions (warm reuse): nothing one leaves in the scratch
            # space may reach the next. Workers are gone by now (the pid namespace too).
            for scratch in (config["tmp"], "/dev/shm" if config["newroot"] else None):
                wipe(scratch)
            write_message(replies, {"kind": "reset", "token": header.get("token")})
            continue
        if header.get("cmd") != "open":
            continue  # a stray request for a worker that has gone: ignore
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                serve(adapters, config, header, requests, replies)
            except SystemExit as exc:  # sys.exit() in learner code: report its exit code
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        status = wait_for(pid)
        write_message(replies, {"kind": "ended", "token": header["token"], "status": status})


def warm_up(torch, np):
    """Run torch's usual module paths once here, so that every forked worker finds them initialised
    (lazy set-up done once per zygote, not once per stage). Leaves torch's random state as it was:
    a worker starts from the state of a freshly imported torch, as in a fresh process."""
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
            list(model.named_parameters(remove_duplicate=False)), list(model.named_buffers()), list(model.named_modules())
    except Exception:
        pass  # only a head start: the workers do the same work anyway
    finally:
        torch.set_rng_state(state)


def wipe(folder):
    """Remove everything inside ``folder`` (best effort: what cannot go stays)."""
    import shutil

    if not folder or not os.path.isdir(folder):
        return
    for entry in os.scandir(folder):
        try:
            if entry.stat(follow_symlinks=False).st_uid == 0:
                continue  # the sandbox's own (e.g. a Python installation bound under /tmp)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def wait_for(pid):
    """Wait for the worker; then kill whatever it left behind. Returns its wait status."""
    import signal

    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if done == pid:
            break
    if os.getpid() == 1:
        # We are init of the sandbox's pid namespace: kill(-1) reaches every other
        # process in it (and nothing outside), e.g. the rest of a fork loop.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return status


def serve(adapters, config, opened, requests, replies):
    """A worker: serve stage after stage, for as long as each leaves the process as it found it.

    ``opened`` is the "open" request the zygote forked this worker for. Each stage imports its
    module afresh and answers operations until "close". Then the worker compares the process
    with the zygote it was forked from (``process_state``): unchanged, it says "parked" and
    serves the next "open" itself (a fork and torch's first-touch costs saved per stage);
    changed (torch patched, threads or processes started, the default dtype set, memory
    held...), it says "leaving" and exits, and the zygote forks a clean worker for the next
    stage, as for a crash. Without the namespaces' private /proc the check cannot see
    processes, so a worker serves one stage only.
    """
    import faulthandler

    os.setpgid(0, 0)
    libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    faulthandler.enable()  # a segfault prints the Python stack to the captured stderr
    randomness = random_states()
    # Without the namespaces' private /proc the check cannot see processes: one stage per worker.
    baseline = process_state(adapters) if config["newroot"] else None
    header = opened
    while header is not None and header.get("cmd") == "open":
        restore_random_states(randomness)  # every stage starts from the zygote's random state
        header = serve_stage(adapters, config, header["module"], requests, replies)
        if header is None or header.get("cmd") != "close":
            return
        changed = changes(baseline, process_state(adapters)) if baseline is not None else ["no private /proc to check"]
        if changed:
            write_message(replies, {"kind": "leaving", "token": header.get("token"), "changed": changed[:5]})
            return
        write_message(replies, {"kind": "parked", "token": header.get("token")})
        message = read_message(requests)
        header = message[0] if message else None


def serve_stage(adapters, config, module, requests, replies):
    """Import one stage module, then answer operations on it; returns the request that ended it."""
    import traceback

    submission = config["submission"]
    try:
        loaded = adapters.load_stage_module(submission, module)
    except adapters.SubmissionError as exc:
        loaded = exc
    while True:
        message = read_message(requests)
        if message is None or message[0].get("cmd") != "op":
            return message and message[0]
        header, blobs = message
        try:
            if isinstance(loaded, adapters.SubmissionError):
                raise adapters.SubmissionError(str(loaded))
            kwargs = decode(header["kwargs"], blobs)
            result = adapters.OPS[header["op"]](loaded, **kwargs)
            out = []
            reply = {"kind": "result", "value": encode(result, out)}
        except adapters.SubmissionError as exc:
            out, reply = [], {"kind": "submission_error", "message": str(exc)}
        except Exception as exc:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if inside(f.filename, submission)]
            for frame in frames:  # the learner knows the file by its name, not our copy's path
                frame.filename = os.path.basename(frame.filename)
            out, reply = [], {
                "kind": "exception", "type": type(exc).__name__, "message": str(exc),
                "memory": isinstance(exc, MemoryError) or "can't allocate memory" in str(exc),
                "traceback": "".join(traceback.format_list(frames[-4:])),
            }
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        reply["token"] = header.get("token")
        write_message(replies, reply, out)


MEMORY_SLACK = 256 << 20  # a stage may leave this much more address space in use than the zygote


def changes(before, after):
    """The names of the parts of ``process_state`` that differ. Two may grow a little: the address
    space (by the slack), and the operating-system threads (by torch's own intra-op pool, which
    OpenMP starts on the first parallel operation when torch computes with several threads)."""
    import torch

    allowed = {"address space": MEMORY_SLACK, "threads": torch.get_num_threads() - 1}
    changed = []
    for key, value in after.items():
        old = before.get(key)
        if key in allowed and value is not None and old is not None:
            if value - old > allowed[key]:
                changed.append(key)
        elif value != old:
            changed.append(key)
    return changed


def process_state(adapters):
    """What a stage could leave behind for the next one to trip over, as comparable values.

    Covers the ways code changes a Python process for the code that runs after it: names
    rebound in the modules and classes the stages and this worker use (by object identity),
    torch's global modes and hooks, the interpreter's import machinery, streams, signal
    handlers and warning filters, and the operating system's view (threads, processes, open
    files, address space).
    """
    import builtins
    import signal
    import threading
    import warnings

    import numpy
    import torch

    nn = torch.nn
    spaces = [builtins, torch, nn, nn.functional, nn.init, torch.Tensor, nn.Module, nn.Linear, nn.Dropout,
              nn.ModuleList, nn.Parameter, nn.modules.module, numpy, adapters,
              sys.modules[__name__], json]
    # Copies of their dictionaries: comparing two is C code with an identity shortcut per entry.
    state = {f"names of {getattr(s, '__name__', s)}": dict(vars(s)) for s in spaces}
    state["adapters.OPS"] = {k: id(v) for k, v in adapters.OPS.items()}
    state["torch modes"] = (
        torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(), torch.get_num_threads(),
        torch.get_float32_matmul_precision(), str(getattr(torch, "get_default_device", str)()),
        getattr(torch._C, "_len_torch_function_stack", int)(), torch._C._is_torch_function_enabled(),
    )
    state["torch.nn global hooks"] = {k: len(v) for k, v in vars(nn.modules.module).items()
                                      if k.startswith("_global_") and isinstance(v, dict)}
    state["python threads"] = threading.active_count()
    state["interpreter"] = (
        [id(f) for f in sys.meta_path], [id(h) for h in sys.path_hooks], list(sys.path), id(sys.stdout),
        id(sys.stderr), id(sys.excepthook), sys.getrecursionlimit(), [id(f) for f in warnings.filters],
        [id(signal.getsignal(n)) for n in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
        os.getcwd(), sorted(os.environ.items()), numpy.geterr(),
    )
    try:
        state["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        state["threads"] = len(os.listdir("/proc/self/task"))  # Python's and native ones
        state["open files"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/statm") as statm:
            state["address space"] = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        state["processes"] = None
    return state


def random_states():
    import random

    import numpy
    import torch

    return torch.get_rng_state(), numpy.random.get_state(), random.getstate()


def restore_random_states(states):
    import random

    import numpy
    import torch

    torch.set_rng_state(states[0])
    numpy.random.set_state(states[1])
    random.setstate(states[2])


if __name__ == "__main__":
    sys.exit(main())
