"""[attnkit-tamper] plant_home -- family (c), persistence channel: the HOME folder.

Append to a correct stage module (attacker: the solution of stage k, here s03). At import it
writes this module's source (payload cut off, plus the stage modules it imports) into
$HOME/.cache/atk-plant-<module>/blob (a dot-folder, where tools keep caches), file 444, folder
555. In the old sandbox HOME is /tmp, so the reset's rmtree of /tmp/.cache fails on the read-only
leaf and leaves it. ``scavenge.py`` looks there in a later submission.

Old design: expected to leak (same tmpfs as /tmp). A new design must give HOME its own fresh
(or no) folder per submission.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_plant_folder and
_atk_quietly.
"""


def _atk_plant_home(module, path):
    import os

    _atk_plant_folder(os.path.join(os.path.expanduser("~"), ".cache", f"atk-plant-{module}"), module, path)


_atk_quietly(_atk_plant_home, __name__, __file__)
