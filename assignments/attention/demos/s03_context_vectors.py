"""Demo of stage s03: context vectors, on a small example."""
import torch
from s01_attention_scores import inputs
from s03_context_vectors import all_context_vectors, context_vector

weights = torch.softmax(inputs @ inputs.T, dim=-1)
print("context vector of 'journey':", context_vector(weights[1], inputs))
print("all context vectors:\n", all_context_vectors(weights, inputs))
