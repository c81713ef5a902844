"""Demo of stage s04: queries, keys and values, on a small example."""
import torch
from s01_attention_scores import inputs
from s04_trainable_projections import context_for_query, project, scaled_weights, scores_for_query

torch.manual_seed(123)
W_query, W_key, W_value = (torch.rand(3, 2) for _ in range(3))
query = project(inputs[1], W_query)
keys, values = project(inputs, W_key), project(inputs, W_value)
weights = scaled_weights(scores_for_query(query, keys), keys.shape[-1])
print("weights:", weights)
print("context vector of 'journey':", context_for_query(weights, values))
