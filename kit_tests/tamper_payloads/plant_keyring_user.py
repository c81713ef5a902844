"""[attnkit-tamper] plant_keyring_user -- family (c), persistence channel: the kernel keyring (user keyring).

Append to a correct stage module (attacker: the solution of stage k, here s11). At import it
plants this module's source (payload cut off, plus the stage modules it imports; zlib) as the key
"atk-plant:<module>:user" in the user keyring (KEY_SPEC_USER_KEYRING = -4), readable by every
process of any uid for 15 minutes: plant_common's _atk_plant_key says how.

Keyrings are not namespaced by mount/pid/net/ipc/uts namespaces. The uid's user keyring lives as
long as the (init) user namespace: a later sandbox with the same uid finds the key by a plain
search. And because of the "other" permissions, /proc/keys shows the key (serial, description) to
ANY process of any uid, which can then read it by serial: ``scavenge.py`` does both.

Old design: expected to leak under ``attnkit grade`` (same uid for the warm zygote) and even under
nbgrader's fresh sandboxes (another uid, which finds the key through /proc/keys and reads it by
serial). Note also that sandbox uids are UID_BASE + (pid % 100000) * 100 + counter % 100: they come
back (pids are reused, the counter wraps after 100 sandboxes), so a later sandbox may even own the
key and its keyrings, with no "other" permission needed.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_plant_key and
_atk_quietly.
"""


def _atk_plant_keyring_user(module, path):
    _atk_plant_key(module, path, "user", -4)


_atk_quietly(_atk_plant_keyring_user, __name__, __file__)
