"""[attnkit-tamper] cell_patch_grader: a code cell a student adds to the notebook (or turns a cell
into). It patches the grading code in the notebook's kernel so that every stage scores its full
points, and swaps the grading run for one that finds nothing wrong.

nbgrader's autograde must drop the cell (grader.course.preprocessors.KeepCourseCells) before the kernel
runs anything.
"""
import grader.course.cells as cells
import grader.grading.scoring as scoring

scoring.stage_score = lambda tests, points: points
cells.Grading.stage = lambda self, marker, points: points
cells.grade_folder = lambda *args: {"fingerprint": "", "seed": 0, "tests": []}
