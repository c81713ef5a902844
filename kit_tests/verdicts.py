"""What a grading record says of a submission's work, in the form kept on record by the kit's tests
(syrupy snapshots in kit_tests/__snapshots__/): for each stage, how many of its checks passed, and,
where some did not, each such check's outcome, the sandbox limit it ran into and the mistakes its
feedback named. Any change to grading that changes a grade of the samples, the catalogue or the
tamper corpus shows up as a difference from the record; ``pytest kit_tests --snapshot-update``
takes a deliberate change on record (review the diff of the .ambr files).

Left out because they depend on the machine: the messages themselves (they quote numbers whose
last digits differ between CPUs) and the CUDA cases (they run only where there is a GPU).
"""
import re

CUDA_CASE = re.compile(r"\[(?:[^\]]*-)?cuda(?:-[^\]]*)?\]")


def verdicts(record: dict) -> dict:
    out = {}
    for stage in record["stages"]:
        tests = [t for t in stage["tests"] if not CUDA_CASE.search(t["nodeid"])]
        passed = sum(t["outcome"] == "passed" for t in tests)
        missed = {}
        for t in tests:
            if t["outcome"] != "passed":
                note = t["outcome"] + (f", limit: {t['limit']}" if t["limit"] else "")
                missed[t["nodeid"].split("::", 1)[1]] = [note, *(f"likely mistake: {m}" for m in t["mistakes"])]
        score = f"{passed} of {len(tests)} pass"
        out[stage["stage"]] = {"score": score, "not passed": missed} if missed else score
    return out
