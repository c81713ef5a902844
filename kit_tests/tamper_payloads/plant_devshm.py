"""[attnkit-tamper] plant_devshm -- family (c), persistence channel /dev/shm.

Append to a correct stage module (attacker: the solution of stage k, here s02). At import it
writes this module's source (payload cut off, plus the stage modules it imports) into
/dev/shm/.atk-plant-<module>/blob, file 444, folder 555, so that the sandbox's "reset" (rmtree with
ignore_errors) leaves it in place. ``scavenge.py`` in a later submission's stub finds and execs it.

Old design (warm zygote keeps its private /dev/shm tmpfs): expected to leak.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_plant_folder and
_atk_quietly.
"""


def _atk_plant_devshm(module, path):
    _atk_plant_folder(f"/dev/shm/.atk-plant-{module}", module, path)


_atk_quietly(_atk_plant_devshm, __name__, __file__)
