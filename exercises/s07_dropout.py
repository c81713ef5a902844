"""Stage 7: dropout on attention weights.

During training, dropout zeroes each weight with probability p and scales the
survivors by 1 / (1 - p), so every weight keeps its expected value. In eval
mode it does nothing.
"""
import torch
import torch.nn as nn


def attention_dropout(attn_weights, p, training=True):
    """Apply ``nn.Dropout(p)`` to the weights, in train or eval mode.

    attn_weights: any shape   p: drop probability   training: the module's mode (the tests pass it by name)
    returns: same shape; attn_weights unchanged when training is False or p = 0
    """
    # TODO: Build the dropout layer, put it in the requested mode, apply it.
    raise NotImplementedError("s07_dropout: attention_dropout: see its TODO")


def dropout_by_hand(x, p):
    """Training-mode dropout without nn.Dropout.

    Zero each element with probability p; scale the kept ones by exactly 1 / (1 - p)
    (p = 0 returns x unchanged).
    Use torch's random generator (e.g. torch.rand_like), so torch.manual_seed applies.
    x: any shape   p: drop probability in [0, 1)   returns: same shape
    """
    # TODO: Draw a keep-mask, zero the dropped elements, rescale the kept ones.
    raise NotImplementedError("s07_dropout: dropout_by_hand: see its TODO")
