"""[attnkit-tamper] plant_keyring_session -- family (c), persistence channel: the kernel keyring (session keyring).

Append to a correct stage module (attacker: the solution of stage k, here s10). At import it plants
this module's source (payload cut off, plus the stage modules it imports; zlib) as the key
"atk-plant:<module>:session" in the session keyring (KEY_SPEC_SESSION_KEYRING = -3), readable by
every process of any uid for 15 minutes: plant_common's _atk_plant_key says how.

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

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_plant_key and
_atk_quietly.
"""


def _atk_plant_keyring_session(module, path):
    _atk_plant_key(module, path, "session", -3)


_atk_quietly(_atk_plant_keyring_session, __name__, __file__)
