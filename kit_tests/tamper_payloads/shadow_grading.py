"""[attnkit-tamper] shadow_grading: a grader/course/cells.py next to the notebook. If the kernel ever
imported it instead of the kit's, it would leave a marker file and give every stage its points."""
import pathlib

pathlib.Path(__file__).with_name("SHADOW-RAN").write_text(__name__)


class Grading:
    def __init__(self, *args, **kwargs):
        pass

    def stage(self, marker, points):
        return points
