"""Stage 3: context vectors.

A context vector is the attention-weighted sum of the input vectors: token i's
context vector mixes every token's embedding in the proportions of row i of
the attention weights.
"""
import torch


def context_vector(attn_weights, inputs):
    """The context vector of one query, summed token by token.

    attn_weights: (num_tokens,) weights of one query, already normalised: use them as given
    inputs: (num_tokens, d_in)   returns: (d_in,)
    """
    # Add up each input vector scaled by its weight.
    ### BEGIN SOLUTION
    context = torch.zeros(inputs.shape[1], dtype=inputs.dtype)
    for weight, x_i in zip(attn_weights, inputs):
        context += weight * x_i
    return context
    ### END SOLUTION


def all_context_vectors(attn_weights, inputs):
    """The context vectors of all tokens in one matrix product.

    attn_weights: (num_tokens, num_tokens), row i holding token i's weights (rows sum to 1;
    the matrix need not be symmetric); use them as given   inputs: (num_tokens, d_in)
    returns: (num_tokens, d_in); row i is token i's context vector
    """
    # Compute every weighted sum in one product: row i of the weights mixes the inputs for token i.
    ### BEGIN SOLUTION
    return attn_weights @ inputs
    ### END SOLUTION
