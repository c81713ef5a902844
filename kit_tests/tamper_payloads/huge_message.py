"""Fail the import with an exception whose message is 8 MB: the grader must keep a bounded part of
it (it ends up in the record, the feedback and the gradebook's worker answers)."""
raise RuntimeError("x" * (8 << 20))
