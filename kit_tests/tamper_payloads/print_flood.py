"""Print 1 GiB on stdout and 1 GiB on stderr at import."""
import sys as _sys

_line = "all work and no play makes jack a dull boy " * 24000 + "\n"  # ~1 MiB
for _ in range(1024):
    _sys.stdout.write(_line)
    _sys.stderr.write(_line)
