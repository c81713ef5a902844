"""[attnkit-tamper] steal_reference -- family (c), the reference a stage is given, planted for the stage it belongs to.

Append to the solution of s09, after the plant_*.py payloads (kit_tests/tamper.py, STEAL_REFERENCE).
Grading runs stage 9 with the REFERENCE behaviour of stage 8 (what it builds on). At import this
looks for that reference's source: the ``provided`` argument of adapters.load_stage_module, found up the
stack of its own import, else in any dict the garbage collector knows (the sandbox's "open"
request that once brought it). It writes it to /tmp/.atk-stolen/s08_causal_attention.py and plants it,
as the source of s08_causal_attention, in every channel of the plant_*.py payloads (the ones
appended before it). ``scavenge.py`` in the stub of stage 8 (of this submission in a later box,
or of a later submission) would find it there and exec it: the reference CausalAttention in place
of a stub. ``stolen()`` names the channels it planted into (empty: no reference was found).

Expected: nothing to steal (no box holds the reference: stage 9 gets a proxy of it, run by the grader's
reference process), and no box that serves stage 8, of this submission or another, ever sees any reference.

Needs the prelude plant_common, and the plant_*.py payloads whose channels it uses, before it.
"""

_ATK_CHANNELS = ("tmp", "devshm", "home", "sysv_shm", "sysv_msg", "posix_shm", "posix_mq", "abstract_socket", "tcp",
                 "keyring_session", "keyring_user")


def _atk_given_reference(name):
    """The reference source of stage module ``name`` that grading gave this module, or None."""
    import gc
    import sys

    frame = sys._getframe()
    while frame is not None:
        given = frame.f_locals.get("provided")
        if isinstance(given, dict) and isinstance(given.get(name), str):
            return given[name]
        frame = frame.f_back
    for obj in gc.get_objects():
        given = dict.get(obj, "provided") if isinstance(obj, dict) else None
        if isinstance(given, dict) and isinstance(dict.get(given, name), str):
            return given[name]
    return None


def _atk_plant_stolen(name):
    """Plant the reference of ``name`` in every channel there is a plant function for; the channels."""
    import os

    text = _atk_given_reference(name)
    if text is None:
        return []
    path = f"/tmp/.atk-stolen/{name}.py"  # the plant functions read a module's source from its file
    try:
        os.makedirs("/tmp/.atk-stolen", exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text)
    except OSError:  # (learner code may not write files when graded)
        return []
    planted = []
    for channel in _ATK_CHANNELS:
        plant = globals().get(f"_atk_plant_{channel}")
        if plant is not None:
            try:
                plant(name, path)
                planted.append(channel)
            except Exception:
                pass
    return planted


_ATK_STOLEN = _atk_plant_stolen("s08_causal_attention")


def stolen():
    return list(_ATK_STOLEN)
