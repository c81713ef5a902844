"""Every number chapter 3 of the book prints along its running example, asserted to 4 decimals
against the reference solutions, each with the section that prints it ("section 3.3.1, attn_scores_2").
The reference is reached through the same adapter as any implementation.
"""
import numpy as np
import pytest

INPUTS = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                   [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]], np.float32)
BATCH = np.stack([INPUTS, INPUTS])
BOOK = dict(d_in=3, d_out=2, context_length=6, dropout=0.0)


def published(actual, printed, source):
    """Equal to the printed 4-decimal value: printing rounds, so within half a unit of the 4th decimal,
    plus room for float32 rounding on another machine. The values here are below 2.5, where one
    float32 step is at most 2.4e-7; 1e-6 allows a few such steps. (Some values sit only 1.1e-7
    inside the rounding bound: a room of 1e-7 would fail on a machine that lands one step away.)"""
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(printed), rtol=0, atol=5e-5 + 1e-6,
                               err_msg=f"printed in {source}")


@pytest.fixture(scope="module")
def ref(reference):
    return {s: reference.stage(s) for s in (
        "s01_attention_scores", "s02_normalization", "s03_context_vectors", "s04_trainable_projections",
        "s05_self_attention", "s06_causal_mask", "s08_causal_attention", "s09_multihead_wrapper",
        "s10_multihead_attention")}


def test_journey_scores(ref):
    for form in ("attention_scores_loop", "attention_scores_matmul"):
        published(getattr(ref["s01_attention_scores"], form)(INPUTS, INPUTS[1]),
                  [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865], "section 3.3.1, attn_scores_2")


def test_both_normalisations_and_context_vector(ref):
    s2 = ref["s02_normalization"]
    scores = ref["s01_attention_scores"].attention_scores_matmul(INPUTS, INPUTS[1])
    published(s2.normalize_by_sum(scores), [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656],
              "section 3.3.1, attn_weights_2_tmp")
    weights = s2.softmax_torch(scores)
    published(weights, [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581], "section 3.3.1, attn_weights_2")
    published(s2.softmax_by_hand(scores), [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
              "section 3.3.1, attn_weights_2")
    published(ref["s03_context_vectors"].context_vector(weights, INPUTS), [0.4419, 0.6515, 0.5683],
              "section 3.3.1, context_vec_2")
    # The sum-normalised weights mixed into a context vector, as published notes on 3.3.1 also print.
    published(ref["s03_context_vectors"].context_vector(s2.normalize_by_sum(scores), INPUTS),
              [0.4355, 0.6451, 0.5680], "published notes on section 3.3.1, context vector from sum-normalised weights")


def test_all_pairs_table(ref):
    s2 = ref["s02_normalization"]
    published(s2.all_pairs_scores(INPUTS), [
        [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310], [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
        [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605], [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
        [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935], [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450]],
        "section 3.3.2, attn_scores")
    weights = s2.all_pairs_weights(INPUTS)
    published(weights, [
        [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452], [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
        [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565], [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
        [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295], [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896]],
        "section 3.3.2, attn_weights")
    published(ref["s03_context_vectors"].all_context_vectors(weights, INPUTS), [
        [0.4421, 0.5931, 0.5790], [0.4419, 0.6515, 0.5683], [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510], [0.4671, 0.5910, 0.5266], [0.4177, 0.6503, 0.5645]],
        "section 3.3.2, all_context_vecs")


def test_trainable_projections_at_seed_123(ref):
    import torch

    torch.manual_seed(123)
    W_query, W_key, W_value = (torch.rand(3, 2).numpy() for _ in range(3))
    s4 = ref["s04_trainable_projections"]
    query_2 = s4.project(INPUTS[1], W_query)
    published(query_2, [0.4306, 1.4551], "section 3.4.1, query_2")
    keys, values = s4.project(INPUTS, W_key), s4.project(INPUTS, W_value)
    published(query_2 @ keys[1], 1.8524, "section 3.4.1, attn_score_22")
    scores = s4.scores_for_query(query_2, keys)
    published(scores, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440], "section 3.4.1, attn_scores_2")
    weights = s4.scaled_weights(scores, 2)
    published(weights, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820], "section 3.4.1, attn_weights_2")
    published(s4.context_for_query(weights, values), [0.3061, 0.8210], "section 3.4.1, context_vec_2")


def test_self_attention_v1_and_v2(ref):
    s5 = ref["s05_self_attention"]
    published(s5.forward("SelfAttention_v1", dict(d_in=3, d_out=2), INPUTS, seed=123), [
        [0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203], [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]],
        "section 3.4.2, SelfAttention_v1 at seed 123")
    v2 = [[-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702], [-0.0760, 0.0685], [-0.0763, 0.0679],
          [-0.0754, 0.0693]]
    published(s5.forward("SelfAttention_v2", dict(d_in=3, d_out=2), INPUTS, seed=789), v2,
              "section 3.4.2, SelfAttention_v2 at seed 789")


def test_both_masked_weight_tables(ref):
    import torch

    torch.manual_seed(789)
    v2 = torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(3, 2, bias=False)
    W_query, W_key = (layer.weight.detach().numpy() for layer in v2)
    scores = (INPUTS @ W_query.T) @ (INPUTS @ W_key.T).T
    published(ref["s02_normalization"].softmax_torch(scores / np.sqrt(2)), [
        [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510], [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
        [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480], [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
        [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585], [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]],
        "section 3.5.1, attn_weights before masking")
    published(np.where(np.triu(np.ones((6, 6), bool), 1), 0, scores)[5],
              [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078], "section 3.5.1, masked_simple (last row)")
    masked = [[1.0, 0, 0, 0, 0, 0], [0.5517, 0.4483, 0, 0, 0, 0], [0.3800, 0.3097, 0.3103, 0, 0, 0],
              [0.2758, 0.2460, 0.2462, 0.2319, 0, 0], [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0],
              [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]]
    s6 = ref["s06_causal_mask"]
    published(s6.causal_weights_simple(ref["s02_normalization"].softmax_torch(scores / np.sqrt(2))), masked,
              "section 3.5.1, masked_simple_norm")
    published(s6.causal_weights_efficient(scores, 2), masked, "section 3.5.1, attn_weights from the -inf mask")


CAUSAL = [[-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632], [-0.5675, -0.0843], [-0.5526, -0.0981],
          [-0.5299, -0.1081]]
SECOND_HEAD = [[0.4772, 0.1063], [0.5891, 0.3257], [0.6202, 0.3860], [0.5478, 0.3589], [0.5321, 0.3428],
               [0.5077, 0.3493]]


def test_causal_attention_at_seed_123(ref):
    """The chapter prints only the shape; its values are the wrapper's first head (same seed, same draws)."""
    out = ref["s08_causal_attention"].forward("CausalAttention", BOOK, BATCH, seed=123)
    published(out, [CAUSAL, CAUSAL], "section 3.6.1, the first head of MultiHeadAttentionWrapper at seed 123")


def test_wrapper_at_seed_123(ref):
    out = ref["s09_multihead_wrapper"].forward("MultiHeadAttentionWrapper", dict(BOOK, num_heads=2), BATCH, seed=123)
    row = [a + b for a, b in zip(CAUSAL, SECOND_HEAD)]
    published(out, [row, row], "section 3.6.1, MultiHeadAttentionWrapper context_vecs")


def test_multihead_attention_at_seed_123(ref):
    out = ref["s10_multihead_attention"].forward("MultiHeadAttention", dict(BOOK, num_heads=2), BATCH, seed=123)
    rows = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593], [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]
    published(out, [rows, rows], "section 3.6.2, MultiHeadAttention context_vecs")


def test_batched_matmul_across_heads(ref):
    a = np.array([[[[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388],
                    [0.7179, 0.7058, 0.9156, 0.4340]],
                   [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737],
                    [0.4606, 0.5159, 0.4220, 0.5786]]]],
                 np.float32)
    expected = [[[[1.3208, 1.1631, 1.2879], [1.1631, 2.2150, 1.8424], [1.2879, 1.8424, 2.0402]],
                 [[0.4391, 0.7003, 0.5903], [0.7003, 1.3737, 1.0620], [0.5903, 1.0620, 0.9912]]]]
    s10 = ref["s10_multihead_attention"]
    published(s10.batched_head_scores(a), expected, "section 3.6.2, a @ a.transpose(2, 3)")
    published(s10.per_head_scores_loop(a), expected, "section 3.6.2, first_head and second_head")
