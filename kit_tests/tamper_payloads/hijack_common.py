"""[attnkit-tamper] hijack_common -- the prelude of the payloads that take over the grading of later work.

Not an attack by itself: it only defines functions and does nothing at import. kit_tests/tamper.py
(PRELUDES) appends it to a stage module before hijack_frames, hijack_gc, hijack_patch_exit and
zygote_mem_patch, which call the functions below. They differ in how they find the sandbox's
pipes and functions; what they do once they have them is here, written once.

Its docstring is the first "[attnkit-tamper]" mark of the module, so the copies made here (the
source cut off at that mark) are the stage modules alone, without any payload.
"""


def _atk_copy_stage_modules(submission, cache, readonly=False):
    """Copy the stage modules (s*.py) of the folder ``submission`` into ``cache``, payloads cut off:
    the attacker's correct modules, that later requests are answered with. ``cache`` is a private
    folder (700, reused if it exists); with ``readonly`` it is a new folder whose files end 444 and
    itself 555, so that an in-sandbox reset that deletes what it can leaves it in place. Where no file may be
    written, nothing happens."""
    import os

    cut = '"""' + "[attnkit-tamper]"  # (in two pieces: the mark stands only where a payload starts)
    try:
        os.makedirs(cache, mode=0o777 if readonly else 0o700, exist_ok=not readonly)
    except OSError:  # refused (graded code may write no file): nothing to copy into
        return
    for name in os.listdir(submission):
        if name.startswith("s") and name.endswith(".py"):
            with open(os.path.join(submission, name)) as handle:
                text = handle.read()
            with open(os.path.join(cache, name), "w") as handle:
                handle.write(text.split(cut)[0] if cut in text else text)
            if readonly:
                os.chmod(os.path.join(cache, name), 0o444)
    if readonly:
        os.chmod(cache, 0o555)


def _atk_requests(wire, requests, deadline):
    """The grader's requests, read from the pipe ``requests`` with the sandbox's own wire format
    (``wire``: the child.py namespace) until ``deadline`` or until the grader closes the pipe:
    (header, blobs) pairs. It waits a second at most between checks of the deadline."""
    import select
    import time

    while time.monotonic() < deadline:
        ready, _, _ = select.select([requests], [], [], 1.0)
        if not ready:
            continue
        message = wire["read_message"](requests)
        if message is None:
            return  # the grader closed the pipe
        yield message


def _atk_answerer(wire, adapters, replies, cache, randomness, tokens, current):
    """``(answer, opened)``, the two requests a daemon answering as the sandbox must understand.

    ``opened(header)`` notes the stage an "open" request names: in ``tokens`` (request token ->
    stage) and as ``current[0]``, the stage last opened (operations may carry tokens of their own);
    the stage is loaded afresh at its next operation. ``answer(module, header, blobs)`` answers an
    "op" request on the pipe ``replies`` the way the sandbox does, but runs the operation on the stage
    ``module`` loaded from ``cache`` (the attacker's modules), each loaded once, from the random state
    ``randomness``."""
    loaded = {}

    def opened(header):
        tokens[header.get("token")] = header.get("module")
        current[0] = header.get("module")
        loaded.pop(header.get("module"), None)

    def answer(module, header, blobs):
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
        reply["token"] = header.get("token")
        wire["write_message"](replies, reply, out)

    return answer, opened
