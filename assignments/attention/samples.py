"""The demo's sample submissions of chapter 3: typical mistakes, each a small edit of the reference
solutions (grader.course.samples; every assignment also has the reference itself and its untouched stubs).
``breaks`` names the stages a sample should lose points on; every other stage must get full marks."""
from grader.course.samples import Sample

SAMPLES = [
    Sample(
        "softmax-dim0", "all-pairs softmax over dim 0 (columns sum to 1)",
        edits={"s02_normalization": [
            ("torch.softmax(all_pairs_scores(inputs), dim=-1)", "torch.softmax(all_pairs_scores(inputs), dim=0)"),
        ]},
        breaks=("normalization",),
    ),
    Sample(
        "no-scaling", "forgot to divide the scores by sqrt(d_k)",
        edits={"s04_trainable_projections": [
            ("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores, dim=-1)"),
        ]},
        breaks=("trainable_projections",),
    ),
    Sample(
        "tril-for-triu", "efficient causal mask built with tril: hides the past instead of the future",
        edits={"s06_causal_mask": [(
            "torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)",
            "torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=-1)",
        )]},
        breaks=("causal_mask",),
    ),
    Sample(
        "no-head-transpose", "split the heads with one view(b, heads, tokens, head_dim), no transpose",
        edits={"s10_multihead_attention": [(
            ".view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)",
            ".view(b, self.num_heads, num_tokens, self.head_dim)",
        )]},
        breaks=("multihead_attention",),
    ),
    Sample(
        "syntax-error", "a missing closing parenthesis in SelfAttention_v1.forward",
        edits={"s05_self_attention": [(
            "attn_scores = queries @ keys.transpose(-2, -1)  # (num_tokens, num_tokens)",
            "attn_scores = queries @ keys.transpose(-2, -1  # (num_tokens, num_tokens)",
        )]},
        breaks=("self_attention",),
    ),
    Sample(
        "endless-loop", "a while loop that never advances its index in context_vector",
        edits={"s03_context_vectors": [(
            "    for weight, x_i in zip(attn_weights, inputs):\n        context += weight * x_i\n",
            "    i = 0\n    while i < len(inputs):\n        context += attn_weights[i] * inputs[i]\n",
        )]},
        breaks=("context_vectors",),
    ),
    Sample(
        "noisy-correct", "correct, but warns and prints to stderr (must still get full marks)",
        edits={"s01_attention_scores": [(
            "import torch\n",
            "import sys\nimport warnings\n\nimport torch\n\n"
            "warnings.warn('s01 imported: this message goes to stderr', UserWarning)\n"
            "print('debug output on stderr', file=sys.stderr)\n",
        ), (
            "    return inputs @ query\n",
            "    warnings.warn('attention_scores_matmul called', RuntimeWarning)\n    return inputs @ query\n",
        )]},
    ),
]
