"""[attnkit-tamper] cell_claim_points: an autograder cell rewritten (unlocked, its points raised) to
print a pass and return its points without grading anything."""
print("PASS")
1000
