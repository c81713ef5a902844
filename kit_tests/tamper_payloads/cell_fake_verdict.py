"""[attnkit-tamper] cell_fake_verdict: a code cell that borrows the metadata of an autograder cell
and sits before it, hoping to take its place: it prints a verdict and returns a score."""
print("all checks pass")
1000
