"""Gradescope's side of the kit's tests: the autograder zip unpacked as Gradescope unpacks it, and the shape and
sums of the results.json it writes (https://gradescope-autograders.readthedocs.io/en/latest/specs/)."""
import zipfile
from pathlib import Path

from grader.kit import plan_points, stage_info

ROOT_KEYS = {"score", "output", "visibility", "stdout_visibility", "tests", "output_format", "test_output_format",
             "test_name_format"}
TEST_KEYS = {"name", "score", "max_score", "output", "visibility", "status"}
VISIBILITIES = {"visible", "hidden", "after_due_date", "after_published"}
TOLERANCE = 1e-6  # sums of hundredths (stage totals) in floating point differ by less


# A check is worth points / counted to four decimals (grader.outputs.gradescope.check_worth): n of them add up to the
# stage's points within n / 20000, and a stage's passed checks to its score (a hundredth) within that and a half.
def worth_tolerance(n: int) -> float:
    return 0.005 + n / 20000 + TOLERANCE


def unzip(archive: Path, dest: Path):
    """Extract like unzip does: with the modes the zip records (zipfile alone drops them)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, dest))
            mode = info.external_attr >> 16 & 0o777
            if mode:
                path.chmod(mode)


def checks(found: dict) -> list[dict]:
    return [t for t in found["tests"] if "max_score" in t]


def validate(found: dict, assignment: str):
    """results.json has Gradescope's shape, and its scores add up: per check, per stage, in all."""
    assert set(found) <= ROOT_KEYS and {"score", "tests"} <= set(found), sorted(found)
    assert isinstance(found["score"], (int, float)) and isinstance(found["tests"], list)
    # Plain text everywhere: the top-level output is in columns, and no learner's text is read as markup.
    assert found["output_format"] == found["test_output_format"] == found["test_name_format"] == "text"
    for t in found["tests"]:
        assert set(t) <= TEST_KEYS and isinstance(t["name"], str) and t["name"], t
        assert t.get("visibility", "visible") in VISIBILITIES, t
        assert isinstance(t.get("output", ""), str), t
        if "max_score" in t:
            assert isinstance(t["score"], (int, float)) and isinstance(t["max_score"], (int, float)), t
            assert 0 <= t["score"] <= t["max_score"] + TOLERANCE, t
    points = plan_points(100, None, assignment)
    assert abs(sum(t["max_score"] for t in checks(found)) - 100) < len(checks(found)) / 20000 + TOLERANCE
    stage_totals = []
    for stage, max_points in points.items():
        heading = stage_info(stage).heading
        mine = [t for t in checks(found) if t["name"].startswith(f"{heading} / ")]
        assert mine, f"no checks of {stage} in results.json"
        assert abs(sum(t["max_score"] for t in mine) - max_points) < len(mine) / 20000 + TOLERANCE, stage
        assert len({t["max_score"] for t in mine if t["max_score"]}) == 1, stage  # every check worth the same
        totals = [t for t in found["tests"] if t["name"].startswith(f"{heading} total: ")]
        assert len(totals) == 1 and "score" not in totals[0], totals  # unscored: no point counted twice
        score = float(totals[0]["name"].split(" total: ")[1].split(" of ")[0])
        assert abs(sum(t["score"] for t in mine) - score) < worth_tolerance(len(mine)), stage
        assert totals[0]["status"] == ("failed" if any(t.get("status") == "failed" for t in mine) else "passed"), stage
        stage_totals.append(score)
    assert abs(sum(stage_totals) - found["score"]) < TOLERANCE  # the score is the stages' totals
