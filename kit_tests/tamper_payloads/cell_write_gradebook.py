"""[attnkit-tamper] cell_write_gradebook: a code cell that appends to the course's gradebook, three
folders up from the submission nbgrader runs the notebook in."""
with open("../../../gradebook.db", "a") as gradebook:
    gradebook.write("x")
