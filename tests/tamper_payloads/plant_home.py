"""[attnkit-tamper] plant_home -- family (c), persistence channel: the HOME folder.

Append to a correct stage module (attacker: the solution of stage k, here s03). At import it
writes this module's source (payload cut off, plus the stage modules it imports) into
$HOME/.cache/atk-plant-<module>/blob (a dot-folder, where tools keep caches), file 444, folder
555. In the old sandbox HOME is /tmp, so the reset's rmtree of /tmp/.cache fails on the read-only
leaf and leaves it. ``scavenge.py`` looks there in a later submission.

Old design: expected to leak (same tmpfs as /tmp). A new design must give HOME its own fresh
(or no) folder per submission.
"""


def _atk_plant_home(module, path):
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

    folder = os.path.join(os.path.expanduser("~"), ".cache", f"atk-plant-{module}")
    if os.path.exists(folder):
        return
    os.makedirs(folder)
    with open(os.path.join(folder, "blob"), "wb") as handle:
        handle.write(blob())
    os.chmod(os.path.join(folder, "blob"), 0o444)
    os.chmod(folder, 0o555)


try:
    _atk_plant_home(__name__, __file__)
except Exception:  # noqa: BLE001
    pass
