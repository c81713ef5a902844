"""[attnkit-tamper] plant_tmp -- family (c), persistence channel /tmp.

Append to a correct stage module (attacker: the solution of stage k, here s01). At import it
writes this module's own source (payload cut off, plus the stage modules it imports) into
/tmp/.atk-plant-<module>/blob, then makes the file 444 and the folder 555: the sandbox's
in-place "reset" (shutil.rmtree(..., ignore_errors=True) of every entry of /tmp) cannot delete a
file in a folder it may not write to, and fails silently. ``scavenge.py`` (in the stub of the
same stage of a later submission) finds it and execs it.

Old design (warm zygote, same uid, same tmpfs): expected to leak to later submissions of the
same grading worker. The attacker's own grade is unaffected (full marks on its solutions).

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_plant_folder and
_atk_quietly.
"""


def _atk_plant_tmp(module, path):
    _atk_plant_folder(f"/tmp/.atk-plant-{module}", module, path)


_atk_quietly(_atk_plant_tmp, __name__, __file__)
