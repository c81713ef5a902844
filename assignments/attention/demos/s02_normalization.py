"""Demo of stage s02: from scores to weights, on a small example."""
from s01_attention_scores import inputs
from s02_normalization import all_pairs_scores, all_pairs_weights, normalize_by_sum, softmax_by_hand, softmax_torch

scores = inputs @ inputs[1]
print("divided by the sum:", normalize_by_sum(scores))
print("softmax by hand:   ", softmax_by_hand(scores))
print("torch.softmax:     ", softmax_torch(scores))
print("all pairs, scores:\n", all_pairs_scores(inputs))
print("all pairs, each row sums to", all_pairs_weights(inputs).sum(dim=-1))
