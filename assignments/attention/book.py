"""The book's running example, as chapter 3 of *Build a Large Language Model (From Scratch)* prints it: the six
journey embeddings, the batch of two copies, the batched-matmul example, and the seeds the book draws its weights
after. The fixtures of chapter 3 and of modern-attention start from these
(``grader.kit.assignment("attention").module("book")``)."""
import numpy as np

BOOK_SEED_V1, BOOK_SEED_V2, BOOK_SEED_MODULES = 123, 789, 123
JOURNEY = np.array(
    [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]],
    dtype=np.float32,
)
BATCH = np.stack([JOURNEY, JOURNEY])  # the book's batch of two identical sequences
# The (b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4) tensor of the batched-matmul example.
HEADS_EXAMPLE = np.array(
    [[[[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388], [0.7179, 0.7058, 0.9156, 0.4340]],
      [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737], [0.4606, 0.5159, 0.4220, 0.5786]]]],
    dtype=np.float32,
)
