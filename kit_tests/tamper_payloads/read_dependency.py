"""[attnkit-tamper] read_dependency -- family (k), reading the source of the stage a stage builds on.

Append to the solution of s09, with ``ATTACK = {"needles": [...], "anchors": [...], "kit": "..."}`` before it: the
SHA-256 of each line (whitespace squeezed out) of the reference s08's solution regions, so that the payload can
recognise the reference without holding it, a few words of it (the lines are hashed only in texts that hold one) and
the kit's folder. Grading runs stage 9 with stage 8's reference behaviour. At
import this looks for that reference's source, bytecode or objects by every route learner code has: the
CausalAttention it imported (inspect, its methods' code objects and constants, dis), sys.modules, every object the
garbage collector knows, the stack frames of every thread, linecache, the files it can open (the kit's solutions,
its own box's folders, /proc/self), and every other process it can see (its command line, environment, memory maps
and memory, its root folder). Whatever it finds (a line of the reference, or another process's memory read), every
call of the wrapper then raises it.

Expected: nothing found under any confinement that holds: the wrapper is the reference's, full marks. (Plain
confinement would find the solutions on disk.)
"""


def _atk_dependency_findings():
    import gc
    import hashlib
    import inspect
    import os
    import re
    import sys
    import types
    import warnings

    warnings.simplefilter("ignore")  # (reading every module's attributes wakes deprecation warnings up)
    needles, anchors = set(ATTACK["needles"]), ATTACK["anchors"]
    findings = []

    anchored = re.compile("|".join(map(re.escape, anchors)))
    anchored_bytes = re.compile("|".join(map(re.escape, anchors)).encode())

    def hits(text, where):
        """A finding if ``text`` holds a line of the reference (its hash; the submission's own lines are not
        among them): lines are hashed only in texts that hold one of its words (the anchors), so that the whole
        heap can be read."""
        kind = type(text)
        if kind is bytes:
            if anchored_bytes.search(text) is None:
                return
            text = text.decode("utf-8", "replace")
        elif kind is not str or anchored.search(text) is None:
            return
        for line in text.splitlines():
            squeezed = "".join(line.split())
            if len(squeezed) >= 20 and hashlib.sha256(squeezed.encode()).hexdigest() in needles:
                findings.append(f"{where}: {line.strip()[:60]}")
                return

    def code_texts(code, seen):
        if code in seen:
            return
        seen.add(code)
        for const in code.co_consts:
            if isinstance(const, str):
                yield const
            elif isinstance(const, types.CodeType):
                yield from code_texts(const, seen)
        yield " ".join(code.co_names)

    # 1. the class it was given, and its module
    cls = globals().get("CausalAttention")
    for obj in (cls, *(vars(cls).values() if cls is not None else ())):
        try:
            hits(inspect.getsource(obj), "inspect.getsource")
        except (OSError, TypeError):
            pass
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is not None:
            for text in code_texts(code, set()):
                hits(text, "a method's code")
    # 2. sys.modules: the source of every module not read from a file of its own (a reference would be one),
    # and every string of every module
    for name, module in list(sys.modules.items()):
        origin = str(getattr(module, "__file__", None) or "<none>")
        if origin.startswith("<") or name[:1] in "smf" and name[1:3].isdigit():
            try:
                hits(inspect.getsource(module), f"inspect.getsource({name})")
            except Exception:
                pass
        for value in list(vars(module).values()) if isinstance(getattr(module, "__dict__", None), dict) else ():
            hits(value, f"sys.modules[{name!r}]")
    # 3. every container the garbage collector knows, and the strings and code objects in it
    seen = set()
    for obj in gc.get_objects():
        values = list(dict.values(obj)) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple)) \
            else []
        for value in values:
            hits(value, "gc")
            if isinstance(value, types.CodeType):
                for text in code_texts(value, seen):
                    hits(text, "gc: a code object")
        if isinstance(obj, types.FunctionType):
            for text in code_texts(obj.__code__, seen):
                hits(text, "gc: a function's code")
    # 4. the stack frames of every thread
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in [*frame.f_locals.values(), *frame.f_globals.values()]:
                hits(value, f"frame {frame.f_code.co_name}")
            frame = frame.f_back
    # 5. linecache, and files
    import linecache

    for name, entry in list(linecache.cache.items()):
        hits("".join(entry[2]) if isinstance(entry, tuple) and len(entry) > 2 else "", f"linecache {name}")
    for path in [os.path.join(ATTACK["kit"], "solutions", "s08_causal_attention.py"),
                 "/sandbox/runtime/s08_causal_attention.py"]:
        try:
            with open(path, "rb") as handle:
                hits(handle.read(), path)
        except OSError:
            pass
    files_read = 0
    for top in ("/sandbox", os.getcwd()):  # (its box's folders: the runtime, its submission, its scratch space)
        for folder, _, files in os.walk(top):
            files_read += len(files)
            for name in files if files_read < 2000 else ():
                try:
                    with open(os.path.join(folder, name), "rb") as handle:
                        hits(handle.read(1 << 20), os.path.join(folder, name))
                except OSError:
                    pass
    # 6. every other process: command line, environment, memory (where its maps can be read), root folder
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as handle:
                    hits(handle.read().replace(b"\0", b"\n"), f"/proc/{pid}/{part}")
            except OSError:
                pass
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as memory:
                ranges = [line.split()[0].split("-") for line in maps if line.split()[1].startswith("r")]
                for start, end in ranges[:200]:
                    memory.seek(int(start, 16))
                    hits(memory.read(min(int(end, 16) - int(start, 16), 1 << 22)), f"/proc/{pid}/mem")
                findings.append(f"read the memory of process {pid}")
        except (OSError, ValueError, OverflowError):
            pass
        try:
            os.listdir(f"/proc/{pid}/root/sandbox")
            findings.append(f"listed the root folder of process {pid}")
        except OSError:
            pass
    return findings


_ATK_FOUND = _atk_dependency_findings()
if _ATK_FOUND:
    def _atk_leaking_forward(self, x):
        raise RuntimeError("FOUND the reference it builds on: " + "; ".join(_ATK_FOUND[:5]))

    MultiHeadAttentionWrapper.forward = _atk_leaking_forward


def dependency_findings():
    return list(_ATK_FOUND)
