"""Stage 4: attention with trainable projections, for one query.

Three weight matrices project each input into a query, a key and a value.
Scores are query-key dot products; they are divided by sqrt(d_k) before the
softmax so that large dimensions do not push softmax into a near one-hot
regime with vanishing gradients. The context vector mixes the values.
"""
import torch


def project(x, W):
    """Project one token (d_in,) or many (num_tokens, d_in) with W: (d_in, d_out).

    returns: (d_out,) or (num_tokens, d_out)
    """
    # TODO: Multiply by W on the right (x @ W): inputs are row vectors.
    raise NotImplementedError("s04_trainable_projections: project: see its TODO")


def scores_for_query(query, keys):
    """Unscaled attention scores of one query against every key.

    query: (d_k,)   keys: (num_tokens, d_k)   returns: (num_tokens,)
    """
    # TODO: Take the dot product of the query with every key.
    raise NotImplementedError("s04_trainable_projections: scores_for_query: see its TODO")


def scaled_weights(scores, d_k):
    """Scaled-dot-product weights: softmax of the scores divided by sqrt(d_k).

    scores: (num_tokens,)   d_k: key dimension (int)   returns: (num_tokens,), sums to 1
    """
    # TODO: Divide by the square root of the key dimension, then softmax.
    raise NotImplementedError("s04_trainable_projections: scaled_weights: see its TODO")


def context_for_query(attn_weights, values):
    """The context vector of one query: the weighted sum of the value vectors.

    attn_weights: (num_tokens,)   values: (num_tokens, d_v)   returns: (d_v,)
    """
    # TODO: Sum the value vectors, weighted by the attention weights (values, not inputs).
    raise NotImplementedError("s04_trainable_projections: context_for_query: see its TODO")
