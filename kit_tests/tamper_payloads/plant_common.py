"""[attnkit-tamper] plant_common -- family (c), the prelude of every plant_*.py payload: what they plant.

Not an attack by itself: it only defines functions and does nothing at import. kit_tests/tamper.py
(PRELUDES) appends it to a stage module before a plant_*.py payload, so both end up in the same
module and the payload calls the functions below; each plant file then keeps only its channel.

Its docstring is the first "[attnkit-tamper]" mark of the module, so the source cut off at that
mark is still the stage module alone, without the prelude or the payload: what scavenge.py execs.
"""


def _atk_quietly(plant, *args):
    """Run ``plant(*args)`` and swallow any error: a plant that fails (a channel that is missing
    or refused) must never cost the attacker the grade of its own correct module, whose import
    goes on."""
    try:
        plant(*args)
    except Exception:
        pass

def _atk_planted_source(module, path):
    """The source of ``module`` (its file is ``path``) and of the stage modules it imports, payloads
    cut off, as the compressed JSON ``{"main": module, "sources": {name: source}}`` that scavenge.py
    unpacks: a stage may need another one (s09 builds on s08's CausalAttention)."""
    import json
    import os
    import re
    import zlib

    cut = '"""' + "[attnkit-tamper]"  # (in two pieces: the mark stands only where a payload starts)
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


def _atk_framed_source(module, path):
    """The planted source behind its length (8 bytes, little-endian), for the channels that give
    back more than was put in (a whole shared-memory object) or in pieces (messages, a stream)."""
    import struct

    data = _atk_planted_source(module, path)
    return struct.pack("<Q", len(data)) + data


def _atk_plant_folder(folder, module, path):
    """Plant the source into ``folder``/blob, then make the file 444 and the folder 555: a reset that
    empties the parent folder with shutil.rmtree(..., ignore_errors=True) cannot delete a file of a
    folder it may not write to, and fails silently. Nothing is done if the folder is there already."""
    import os

    if os.path.exists(folder):
        return
    os.makedirs(folder)  # (refused where graded code may write no file: the plant payloads catch that)
    with open(os.path.join(folder, "blob"), "wb") as handle:
        handle.write(_atk_planted_source(module, path))
    os.chmod(os.path.join(folder, "blob"), 0o444)
    os.chmod(folder, 0o555)


def _atk_plant_key(module, path, kind, ring):
    """Plant the source as a "user" key described "atk-plant:<module>:<kind>": added to the process
    keyring, its permissions opened to everybody (KEYCTL_SETPERM 0x3f3f3f3f: possessor, user, group
    and OTHER may view, read, search...), given a 15-minute timeout (so that a test run leaves
    nothing for long), then linked into the keyring ``ring`` (-3: the session keyring, -4: the user
    keyring). add_key and keyctl are raw syscalls through ctypes."""
    import ctypes
    import os

    calls = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)
    if calls is None:
        return
    add_key, keyctl = calls
    libc = ctypes.CDLL(None, use_errno=True)
    data = _atk_planted_source(module, path)
    description = f"atk-plant:{module}:{kind}".encode()
    # Added first to the process keyring (-2), which this process possesses, so that the permissions
    # can be set whatever the target keyring (a key of the user keyring is not possessed once the
    # process has joined a session keyring of its own), then linked into the target keyring.
    key = libc.syscall(add_key, b"user", description, data, ctypes.c_size_t(len(data)), ctypes.c_long(-2))
    if key < 0:
        return
    libc.syscall(keyctl, 5, ctypes.c_long(key), ctypes.c_ulong(0x3F3F3F3F))  # KEYCTL_SETPERM
    libc.syscall(keyctl, 15, ctypes.c_long(key), ctypes.c_ulong(900))  # KEYCTL_SET_TIMEOUT
    libc.syscall(keyctl, 8, ctypes.c_long(key), ctypes.c_long(ring))  # KEYCTL_LINK into the target keyring
