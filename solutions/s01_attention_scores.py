"""Stage 1: attention scores for one query.

The running example is the sentence "Your journey starts with one step", one
3-dimensional embedding per token. The query is the second token, "journey"
(``inputs[1]``). A score says how much the query "resembles" each token: the
dot product of the two vectors.

Both functions work for any num_tokens and d_in, and for any query vector, not
only a row of ``inputs``. They take float32 tensors and return a torch tensor.
"""
import torch

# One row per token of "Your journey starts with one step".
inputs = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ]
)


def attention_scores_loop(inputs, query):
    """Score every token against ``query`` with a Python loop.

    inputs: (num_tokens, d_in)   query: (d_in,)   returns: (num_tokens,)
    """
    # Score each token on its own: one torch.dot per row of inputs.
    ### BEGIN SOLUTION
    scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        scores[i] = torch.dot(x_i, query)
    return scores
    ### END SOLUTION


def attention_scores_matmul(inputs, query):
    """The same scores as ``attention_scores_loop`` in one matrix product.

    inputs: (num_tokens, d_in)   query: (d_in,)   returns: (num_tokens,)
    """
    # Score all tokens at once: a matrix-vector product replaces the loop.
    ### BEGIN SOLUTION
    return inputs @ query
    ### END SOLUTION
