"""Demo of stage s01: attention scores, on a small example."""
from s01_attention_scores import attention_scores_loop, attention_scores_matmul, inputs

query = inputs[1]  # "journey"
print("loop:  ", attention_scores_loop(inputs, query))
print("matmul:", attention_scores_matmul(inputs, query))
