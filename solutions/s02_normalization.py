"""Stage 2: turning scores into attention weights.

Weights must be non-negative and sum to 1 so that a context vector is a
weighted average. Dividing by the sum does that for positive scores; softmax
does it for any scores and is what attention uses.
"""
import torch


def normalize_by_sum(scores):
    """Divide the scores by their sum (the naive normalisation).

    scores: (num_tokens,)   returns: (num_tokens,), sums to 1
    """
    # Divide every score by the total so that the weights add up to 1.
    ### BEGIN SOLUTION
    return scores / scores.sum()
    ### END SOLUTION


def softmax_by_hand(x, dim=-1):
    """Softmax written with exp and sum only (no torch.softmax), stable for large x.

    x: any shape, its values possibly in the thousands (of either sign): no inf or NaN
    dim: the dimension to normalise (the tests pass it by name)
    returns: same shape, sums to 1 along ``dim``
    """
    # Subtract the max along dim before exp: softmax is unchanged by a shift,
    # and exp can no longer overflow to inf.
    ### BEGIN SOLUTION
    shifted = x - x.max(dim=dim, keepdim=True).values
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)
    ### END SOLUTION


def softmax_torch(scores):
    """Softmax of the scores with PyTorch's own ``torch.softmax`` over the last dim.

    scores: (..., num_tokens)   returns: same shape
    """
    # Use the library softmax over the last dimension.
    ### BEGIN SOLUTION
    return torch.softmax(scores, dim=-1)
    ### END SOLUTION


def all_pairs_scores(inputs):
    """Scores of every token (row) against every token (column).

    inputs: (num_tokens, d_in)   returns: (num_tokens, num_tokens); row i is token i's query
    """
    # Compute every dot product in one matrix product: inputs times its transpose.
    ### BEGIN SOLUTION
    return inputs @ inputs.T
    ### END SOLUTION


def all_pairs_weights(inputs):
    """Attention weights of every token: softmax of each row of ``all_pairs_scores``.

    inputs: (num_tokens, d_in)   returns: (num_tokens, num_tokens), every row sums to 1
    """
    # Normalise each query's row of scores (the last dimension), not each column.
    ### BEGIN SOLUTION
    return torch.softmax(all_pairs_scores(inputs), dim=-1)
    ### END SOLUTION
