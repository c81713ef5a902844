"""Stage 6: causal masks.

A language model predicts the next token, so token i may only attend to
tokens 0..i. Two ways to hide the future:

* simple: softmax as usual, zero the weights above the diagonal (tril mask),
  then divide each row by its new sum;
* efficient: put -inf in the scores above the diagonal (triu mask), then
  softmax; exp(-inf) = 0, so the masked weights come out exactly 0 and the
  rows already sum to 1.

Both give the same weights. All functions accept a leading batch dimension,
and any num_tokens >= 1. In both forms every weight above the diagonal must be
exactly 0 (checked with no tolerance, not merely small), every row sums to 1,
and the scores above the diagonal have no influence on any weight.
"""
import torch


def causal_weights_simple(attn_weights):
    """Mask already-normalised weights with a lower-triangular mask and renormalise.

    attn_weights: (..., num_tokens, num_tokens)   returns: same shape
    """
    # TODO: Keep the lower triangle (diagonal included), then make every row sum to 1 again.
    raise NotImplementedError("s06_causal_mask: causal_weights_simple: see its TODO")


def causal_weights_efficient(attn_scores, d_k):
    """Mask raw scores with -inf above the diagonal, then take the scaled softmax.

    attn_scores: (..., num_tokens, num_tokens) unscaled   d_k: key dimension (int)
    returns: (..., num_tokens, num_tokens)
    """
    # TODO: Fill the strict upper triangle with -inf; softmax over the last dim turns it into 0.
    raise NotImplementedError("s06_causal_mask: causal_weights_efficient: see its TODO")
