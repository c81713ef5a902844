"""The course side: nbgrader's course, gradebook, notebooks, feedback and reports.

nbgrader imports nbformat, which imports jsonschema; where the optional package rfc3987-syntax (1.1.0) is installed,
jsonschema imports it to check the "iri" string formats, and it builds its 38 grammars at import: about 2 s of CPU
in every process that opens a gradebook (python-jsonschema/jsonschema issue 1428). Neither nbformat nor nbgrader
checks string formats, so the kit's processes go without it: jsonschema then skips those two formats, as it does
where the package is not installed.
"""
import sys

sys.modules.setdefault("rfc3987_syntax", None)  # (an import of it raises ImportError, which jsonschema expects)
