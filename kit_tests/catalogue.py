"""A catalogue of realistic submissions: typical mistakes and correct-but-different solutions.

Each entry is a small edit of one reference module. ``BUGS`` must lose points on
their stage and nowhere else (a stage that imports another is graded with the
reference version of it), and their feedback should name the mistake
(``diagnosis``: words the feedback must contain; None where no test can tell the
cause) and never send its author to a wrong fix (``not_said``: words of a hint
that was once shown for it and was wrong). ``VARIANTS`` are correct and must get
full marks. Many bugs were found in published code (notes on chapter 3 of the
book, KV caches, sliding windows and tiled kernels that repositories shipped and
later fixed); ``source`` says where.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grader.course.samples import by_student, edited, write_modules
from grader.kit import SOLUTIONS, assignment_of


@dataclass(frozen=True)
class Submission:
    name: str
    stage: str  # the module the edits apply to
    edits: tuple  # (old, new) pairs (grader.course.samples.edited)
    why: str
    diagnosis: str | None = None
    source: str = "typical learner mistake"
    not_said: tuple = ()  # words no feedback of this submission may contain (a hint pointing to a wrong fix)

    def modules(self) -> dict[str, str]:
        """The edited module (stage module -> source); the others are the reference's."""
        return {self.stage: edited((SOLUTIONS / f"{self.stage}.py").read_text(), self.edits, self.name)}

    def build(self, dest: Path) -> Path:
        """The submission folder: the reference with the edits applied."""
        return write_modules(dest, replaced=self.modules(), assignment=self.assignment)

    @property
    def assignment(self) -> str:
        return assignment_of(self.stage)


S01, S02, S03, S04 = "s01_attention_scores", "s02_normalization", "s03_context_vectors", "s04_trainable_projections"
S05, S06, S07, S08 = "s05_self_attention", "s06_causal_mask", "s07_dropout", "s08_causal_attention"
S09, S10, S11 = "s09_multihead_wrapper", "s10_multihead_attention", "s11_other_forms"

# Stage 10's attention from the scores to the context vectors (what an SDPA-based module replaces).
S10_ATTENTION = """        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_tokens)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        # Scale by the width of one head, the d_k of each head's dot products.
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)"""

BUGS = [
    Submission("scores_against_journey_always", S01,
               (("scores[i] = torch.dot(x_i, query)", "scores[i] = torch.dot(x_i, inputs[1])"),),
               "the loop scores against inputs[1] instead of the given query", "instead of the given query"),
    Submission("scores_of_all_pairs", S01, (("return inputs @ query", "return inputs @ inputs.T"),),
               "the matmul form computes every pair's score", "every pair of tokens"),
    Submission("softmax_over_columns", S02,
               (("torch.softmax(all_pairs_scores(inputs), dim=-1)",
                 "torch.softmax(all_pairs_scores(inputs), dim=0)"),),
               "all-pairs weights normalised over dim 0", "softmax over the wrong dimension"),
    Submission("unstable_softmax", S02,
               (("shifted = x - x.max(dim=dim, keepdim=True).values", "shifted = x"),),
               "softmax by hand without subtracting the max: exp overflows on large scores",
               "subtract each row's max"),
    Submission("softmax_sums_everything", S02,
               (("return exp / exp.sum(dim=dim, keepdim=True)", "return exp / exp.sum()"),),
               "softmax by hand divides by the sum over the whole tensor", "sum over the whole tensor"),
    Submission("sum_normalisation_is_softmax", S02,
               (("return scores / scores.sum()", "return torch.softmax(scores, dim=0)"),),
               "normalize_by_sum uses softmax", "softmax instead of dividing by the sum"),
    Submission("context_with_transposed_weights", S03,
               (("return attn_weights @ inputs", "return attn_weights.T @ inputs"),),
               "all context vectors with the weights transposed", "the weights were transposed"),
    Submission("context_without_weights", S03, (("context += weight * x_i", "context += x_i"),),
               "the context vector sums the inputs without weights", "without their weights"),
    Submission("no_scaling", S04,
               (("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores, dim=-1)"),),
               "scores not scaled before softmax", "the scaling by 1 / sqrt(d_k) is missing"),
    Submission("scaling_by_d_k", S04,
               (("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores / d_k, dim=-1)"),),
               "scores divided by d_k instead of sqrt(d_k)", "divided by d_k"),
    Submission("scaled_after_the_softmax", S04,
               (("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores, dim=-1) / d_k**0.5"),),
               "the weights divided by sqrt(d_k) after the softmax instead of the scores before it",
               "scaled after the softmax"),
    Submission("multiplying_by_sqrt_d_k", S04,
               (("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores * d_k**0.5, dim=-1)"),),
               "scores multiplied by sqrt(d_k)", "multiplied by sqrt(d_k)",
               source="published notes on section 3.5 (a SingleHeadCausalSelfAttention module)"),
    Submission("projection_written_as_W_times_x", S04, (("    return x @ W\n", "    return W.T @ x.T\n"),),
               "W^T x from the maths notation: right for one token, transposed for a matrix of tokens",
               "transpose is missing or extra"),
    Submission("transposed_scores", S05,
               (("attn_scores = queries @ keys.transpose(-2, -1)  # (num_tokens, num_tokens)",
                 "attn_scores = keys @ queries.transpose(-2, -1)  # (num_tokens, num_tokens)"),),
               "keys @ queries.T: each row holds one key's scores", "scores are transposed",
               source="published notes on section 3.5.1 (the causal mask)"),
    Submission("v2_ignores_qkv_bias", S05,
               (("nn.Linear(d_in, d_out, bias=qkv_bias)", "nn.Linear(d_in, d_out, bias=False)"),),
               "SelfAttention_v2 never creates biases", "bias=qkv_bias"),
    Submission("tril_instead_of_triu", S06,
               (("torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)",
                 "torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=-1)"),),
               "the efficient mask hides the past", "hides the past instead of the future"),
    Submission("mask_with_zero", S06, (("masked_fill(mask, -torch.inf)", "masked_fill(mask, 0.0)"),),
               "masked scores set to 0 instead of -inf", "masked with 0 instead of -inf"),
    Submission("mask_without_renormalising", S06,
               (("return masked_simple / masked_simple.sum(dim=-1, keepdim=True)", "return masked_simple"),),
               "the simple mask zeroes the future but does not renormalise", "renormalis"),
    Submission("softmax_over_dim_1", S06,
               (("torch.softmax(masked / d_k**0.5, dim=-1)", "torch.softmax(masked / d_k**0.5, dim=1)"),),
               "softmax over dim=1, right for one table, wrong for a batch", "softmax over the wrong dimension",
               source="published notes on section 3.5.1 (the efficient causal mask)"),
    Submission("dropout_in_eval_mode", S07, (("dropout.train(training)", "dropout.train(True)"),),
               "dropout stays active in eval mode", "eval mode"),
    Submission("dropout_not_rescaled", S07, (("return x * keep / (1 - p)", "return x * keep"),),
               "kept values not rescaled by 1/(1-p)", "not rescaled"),
    Submission("dropout_keeps_p", S07, (("keep = torch.rand_like(x) >= p", "keep = torch.rand_like(x) < p"),),
               "p taken as the probability of keeping", "probability of DROPPING"),
    Submission("causal_attention_ignores_qkv_bias", S08,
               (("nn.Linear(d_in, d_out, bias=qkv_bias)", "nn.Linear(d_in, d_out, bias=False)"),),
               "CausalAttention never creates biases", "bias=qkv_bias",
               source="published notes on section 3.5.3 (CausalAttention)"),
    Submission("mask_not_truncated", S08,
               (("mask_bool = self.mask.bool()[:num_tokens, :num_tokens]", "mask_bool = self.mask.bool()"),),
               "the full context_length mask is used for shorter sequences",
               "a tensor sized by context_length met one sized by the sequence"),
    Submission("mask_not_a_buffer", S08,
               (('self.register_buffer(\n'
                 '            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)\n'
                 '        )',
                 "self.mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)"),),
               "the mask is a plain attribute, not a registered buffer", "register_buffer"),
    Submission("dropout_never_applied", S08,
               (("        attn_weights = self.dropout(attn_weights)\n", ""),),
               "self.dropout is created but never applied", "dropped nothing",
               source="published notes on section 3.5.3 (CausalAttention)"),
    Submission("dropout_on_the_context_vectors", S08,
               (("        attn_weights = self.dropout(attn_weights)\n        return attn_weights @ values",
                 "        return self.dropout(attn_weights @ values)"),),
               "dropout applied to the context vectors instead of the attention weights: on one-hot values the "
               "two are the same numbers, on dense values it zeroes single features", "dropout zeroed single features"),
    Submission("sequence_length_hard_coded", S08,
               (("self.mask.bool()[:num_tokens, :num_tokens]", "self.mask.bool()[:6, :6]"),),
               "the mask is cut to the book's 6 tokens", "no size of this check is 6"),
    Submission("heads_share_weights", S09,
               (("[CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]",
                 "[CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)] * num_heads"),),
               "one CausalAttention repeated: all heads share weights", "new CausalAttention for every head"),
    Submission("heads_concatenated_on_tokens", S09,
               (("torch.cat([head(x) for head in self.heads], dim=-1)",
                 "torch.cat([head(x) for head in self.heads], dim=1)"),),
               "heads concatenated along the token axis", "last dimension"),
    Submission("split_without_transpose", S10,
               ((".view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)",
                 ".view(b, self.num_heads, num_tokens, self.head_dim)"),),
               "heads split with view alone", "split with view alone"),
    Submission("scaled_by_model_width", S10,
               (("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores / self.d_out ** 0.5, dim=-1)"),),
               "scores scaled by sqrt(d_out) instead of sqrt(head_dim)", "scaled by sqrt(d_out)"),
    Submission("missing_out_proj", S10, (("return self.out_proj(context_vec)", "return context_vec"),),
               "out_proj never applied", "out_proj is missing or, as written, has no effect"),
    Submission("view_without_contiguous", S10,
               (("context_vec.contiguous().view(b, num_tokens, self.d_out)",
                 "context_vec.view(b, num_tokens, self.d_out)"),),
               "view after transpose without contiguous()", "contiguous"),
    Submission("values_are_inputs", S10, (("values = self.W_value(x)", "values = x"),),
               "the values are the raw inputs", "the tensor holds d_in",
               not_said=("instead of hard-coding",)),
    Submission("num_heads_never_stored", S10, (("        self.num_heads = num_heads\n", ""),),
               "self.num_heads is used but never set", "self.num_heads is used but never set",
               source="published notes on section 3.6.2 (a copy of MultiHeadAttention)"),
    Submission("batch_size_hard_coded", S10,
               (("b, num_tokens, d_in = x.shape", "b, num_tokens, d_in = 2, x.shape[1], x.shape[2]"),),
               "the batch size is fixed to the book's 2", "where x's batch size b is"),
    Submission("qkv_stacked_in_wrong_order", S11,
               (('[sd["W_query.weight"], sd["W_key.weight"], sd["W_value.weight"]]',
                 '[sd["W_key.weight"], sd["W_query.weight"], sd["W_value.weight"]]'),),
               "W_qkv stacks key rows before query rows", "query, key, value"),
    Submission("head_reads_a_global_size", S11,
               (("import torch.nn as nn\n", "import torch.nn as nn\n\nC = 3  # the embedding size of the example\n"),
                ("nn.Linear(d_in, head_dim, bias=qkv_bias)", "nn.Linear(C, head_dim, bias=qkv_bias)")),
               "Head takes its input size from a global instead of d_in", "it takes inputs of width",
               source="published notes on per-head attention modules (Head)",
               not_said=("the output has width d_out",)),
    # The same mistakes, in every later stage where they can be made again.
    Submission("context_softmax_again", S03,
               (("return attn_weights @ inputs", "return torch.softmax(attn_weights, dim=-1) @ inputs"),),
               "softmax applied to weights that are already normalised", "already normalised"),
    Submission("context_for_query_softmax_again", S04,
               (("return attn_weights @ values", "return torch.softmax(attn_weights, dim=-1) @ values"),),
               "softmax applied to weights that are already normalised", "already normalised"),
    Submission("v2_transposed_scores", S05,
               (("        attn_scores = queries @ keys.transpose(-2, -1)\n",
                 "        attn_scores = keys @ queries.transpose(-2, -1)\n"),),
               "SelfAttention_v2 computes keys @ queries.T", "scores are transposed"),
    Submission("self_attention_scores_times_sqrt_d_k", S05,
               (("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores * keys.shape[-1] ** 0.5, dim=-1)"),),
               "both SelfAttention classes multiply the scores by sqrt(d_k)", "multiplied by sqrt(d_k)"),
    Submission("v2_double_softmax", S05,
               (("return attn_weights @ values\n        ### END SOLUTION\n\n\ndef transfer",
                 "return torch.softmax(attn_weights, dim=-1) @ values\n        ### END SOLUTION\n\n\ndef transfer"),),
               "SelfAttention_v2 applies softmax to its weights again", "softmax was applied twice"),
    Submission("efficient_mask_times_sqrt_d_k", S06,
               (("torch.softmax(masked / d_k**0.5, dim=-1)", "torch.softmax(masked * d_k**0.5, dim=-1)"),),
               "the efficient mask multiplies the scores by sqrt(d_k)", "multiplied by sqrt(d_k)"),
    Submission("softmax_dim_1_times_sqrt_d_k", S06,
               (("torch.softmax(masked / d_k**0.5, dim=-1)", "torch.softmax(masked * d_k**0.5, dim=1)"),),
               "softmax over dim=1 (the query axis of a batch) of scores multiplied by sqrt(d_k)",
               "two mistakes at once",
               source="published notes on section 3.5.1 (the efficient causal mask)"),
    Submission("simple_mask_renormalised_with_softmax", S06,
               (("return masked_simple / masked_simple.sum(dim=-1, keepdim=True)",
                 "return torch.softmax(masked_simple, dim=-1)"),),
               "the masked weights renormalised with a second softmax", "already normalised"),
    Submission("causal_scores_times_sqrt_d_k", S08,
               (("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores * keys.shape[-1] ** 0.5, dim=-1)"),),
               "CausalAttention multiplies the scores by sqrt(d_k)", "multiplied by sqrt(d_k)"),
    Submission("causal_double_softmax", S08,
               (("return attn_weights @ values  # (b, num_tokens, d_out)",
                 "return torch.softmax(attn_weights, dim=-1) @ values"),),
               "CausalAttention applies softmax to its weights again", "softmax was applied twice"),
    Submission("causal_transposed_scores", S08,
               (("attn_scores = queries @ keys.transpose(1, 2)", "attn_scores = keys @ queries.transpose(1, 2)"),),
               "CausalAttention computes keys @ queries^T", "scores are transposed"),
    Submission("causal_dropout_in_eval_mode", S08,
               (("attn_weights = self.dropout(attn_weights)",
                 "attn_weights = torch.nn.functional.dropout(attn_weights, self.dropout.p)"),),
               "F.dropout without training=self.training drops in eval mode too", "eval mode"),
    Submission("causal_mask_reads_a_global_length", S08,
               (("import torch.nn as nn\n", "import torch.nn as nn\n\nCONTEXT_LENGTH = 6  # the book's batch\n"),
                ("torch.ones(context_length, context_length)", "torch.ones(CONTEXT_LENGTH, CONTEXT_LENGTH)")),
               "the mask is sized by a global instead of context_length", "constructor's arguments"),
    Submission("wrapper_heads_without_dropout", S09,
               (("CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)",
                 "CausalAttention(d_in, d_out, context_length, 0.0, qkv_bias)"),),
               "the wrapper does not pass dropout on to its heads", "dropped nothing"),
    Submission("mha_scores_times_sqrt_d_k", S10,
               (("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores * keys.shape[-1] ** 0.5, dim=-1)"),),
               "MultiHeadAttention multiplies the scores by sqrt(head_dim)", "multiplied by sqrt(head_dim)"),
    Submission("mha_double_softmax", S10,
               (("context_vec = (attn_weights @ values).transpose(1, 2)",
                 "context_vec = (torch.softmax(attn_weights, dim=-1) @ values).transpose(1, 2)"),),
               "MultiHeadAttention applies softmax to its weights again", "softmax was applied twice"),
    Submission("mha_transposed_scores", S10,
               (("attn_scores = queries @ keys.transpose(2, 3)", "attn_scores = keys @ queries.transpose(2, 3)"),),
               "MultiHeadAttention computes keys @ queries^T", "scores are transposed"),
    Submission("mha_ignores_qkv_bias", S10,
               (("nn.Linear(d_in, d_out, bias=qkv_bias)", "nn.Linear(d_in, d_out, bias=False)"),),
               "MultiHeadAttention never creates the projections' biases", "bias=qkv_bias"),
    Submission("sdpa_mask_not_inverted", S10,
               ((S10_ATTENTION,
                 """        context_vec = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask.bool()[:num_tokens, :num_tokens],
            dropout_p=self.dropout.p if self.training else 0.0,
        ).transpose(1, 2)"""),),
               "F.scaled_dot_product_attention given the causal buffer as it is (True = masked out)",
               "True where a token takes part"),
    Submission("mha_dropout_never_applied", S10, (("        attn_weights = self.dropout(attn_weights)\n", ""),),
               "MultiHeadAttention creates self.dropout but never applies it", "dropped nothing"),
    Submission("mha_dropout_on_the_context_vectors", S10,
               (("        attn_weights = self.dropout(attn_weights)\n\n        context_vec = (attn_weights @ values)",
                 "\n        context_vec = self.dropout(attn_weights @ values)"),),
               "dropout applied to each head's context vectors instead of the attention weights",
               "dropout zeroed single features"),
    Submission("mha_reads_a_global_head_count", S10,
               (("import torch.nn as nn\n", "import torch.nn as nn\n\nNUM_HEADS = 2  # the book's example\n"),
                ("        self.num_heads = num_heads\n        self.head_dim = d_out // num_heads\n",
                 "        self.num_heads = NUM_HEADS\n        self.head_dim = d_out // NUM_HEADS\n")),
               "the heads are split by a global head count", "constructor's arguments",
               not_said=("instead of hard-coding",)),
    Submission("forms_scores_times_sqrt_d_k", S11,
               (("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores * keys.shape[-1] ** 0.5, dim=-1)"),),
               "both forms multiply the scores by sqrt(head_dim)", "multiplied by sqrt(head_dim)"),
    Submission("combined_double_softmax", S11,
               (("context_vec = (attn_weights @ values).transpose(1, 2)",
                 "context_vec = (torch.softmax(attn_weights, dim=-1) @ values).transpose(1, 2)"),),
               "the fused form applies softmax to its weights again", "softmax was applied twice"),
    Submission("combined_transposed_scores", S11,
               (("attn_scores = queries @ keys.transpose(2, 3)", "attn_scores = keys @ queries.transpose(2, 3)"),),
               "the fused form computes keys @ queries^T", "scores are transposed"),
    Submission("combined_ignores_qkv_bias", S11,
               (("nn.Linear(d_in, 3 * d_out, bias=qkv_bias)", "nn.Linear(d_in, 3 * d_out, bias=False)"),),
               "W_qkv never has a bias", "bias=qkv_bias"),
    Submission("head_always_has_biases", S11,
               (("nn.Linear(d_in, head_dim, bias=qkv_bias)", "nn.Linear(d_in, head_dim)"),),
               "Head's projections always have biases", "bias=qkv_bias"),
    Submission("combined_output_width_from_x", S11,
               (("context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)",
                 "context_vec = context_vec.contiguous().view(b, num_tokens, d_in)"),),
               "the fused form takes its output width from x (nanoGPT's C, where d_in == d_out)",
               "Per token: the view asks for d_in", source="nanoGPT's CausalSelfAttention, where d_in == d_out",
               not_said=("instead of hard-coding",)),
    Submission("combined_dropout_skipped", S11,
               (("        attn_weights = self.dropout(attn_weights)\n\n        context_vec",
                 "\n        context_vec"),),
               "the fused form never applies its dropout", "dropped nothing"),
    Submission("head_dropout_skipped", S11,
               (("        attn_weights = self.dropout(attn_weights)\n        return attn_weights @ values",
                 "        return attn_weights @ values"),),
               "Head never applies its dropout", "dropped nothing"),
    Submission("fused_form_with_resid_dropout", S11,
               (("        self.dropout = nn.Dropout(dropout)\n        mask = torch.triu",
                 "        self.dropout = nn.Dropout(dropout)\n        self.resid_dropout = nn.Dropout(dropout)\n"
                 "        mask = torch.triu"),
                ("        return self.out_proj(context_vec)\n",
                 "        return self.resid_dropout(self.out_proj(context_vec))\n")),
               "nanoGPT's CausalSelfAttention kept whole: its resid_dropout after the output projection drops a "
               "second time in training mode", "dropout was applied twice",
               source="nanoGPT's CausalSelfAttention (attn_dropout and resid_dropout)",
               not_said=("probability of DROPPING",)),
    Submission("forms_dropout_in_eval_mode", S11,
               (("attn_weights = self.dropout(attn_weights)",
                 "attn_weights = torch.nn.functional.dropout(attn_weights, self.dropout.p)"),),
               "F.dropout without training=self.training: both forms drop in eval mode too", "eval mode"),
]


VARIANTS = [
    Submission("keys_created_first", S05,
               (("        self.W_query = nn.Parameter(torch.rand(d_in, d_out))\n"
                 "        self.W_key = nn.Parameter(torch.rand(d_in, d_out))\n",
                 "        self.W_key = nn.Parameter(torch.rand(d_in, d_out))\n"
                 "        self.W_query = nn.Parameter(torch.rand(d_in, d_out))\n"),
                ("        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)\n"
                 "        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)\n",
                 "        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)\n"
                 "        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)\n")),
               "parameters created in another order (W_key before W_query)", source="published notes on section 3.4.2"),
    Submission("einsum_scores", S10,
               (("attn_scores = queries @ keys.transpose(2, 3)",
                 'attn_scores = torch.einsum("bhqd,bhkd->bhqk", queries, keys)'),),
               "scores with einsum"),
    Submission("reshape_instead_of_view", S10,
               ((".view(", ".reshape("), (".contiguous()", "")),
               "reshape everywhere instead of contiguous + view"),
    Submission("sdpa_inside", S10,
               ((S10_ATTENTION,
                 """        allowed = ~self.mask.bool()[:num_tokens, :num_tokens]
        context_vec = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed, dropout_p=self.dropout.p if self.training else 0.0
        ).transpose(1, 2)"""),),
               "F.scaled_dot_product_attention with the registered mask"),
    Submission("large_negative_instead_of_inf", S08,
               (("masked_fill(mask_bool, -torch.inf)", "masked_fill(mask_bool, -1e9)"),),
               "masking with -1e9 instead of -inf"),
    Submission("scaling_before_masking", S08,
               (("""        attn_scores = queries @ keys.transpose(1, 2)  # (b, num_tokens, num_tokens)""",
                 """        attn_scores = queries @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5"""),
                ("torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)", "torch.softmax(attn_scores, dim=-1)")),
               "scaling the scores before masking them"),
    Submission("fused_qkv_with_state_dict_hook", S10,
               (("""        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
""", """        self.W_qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        # Accept state_dicts with the documented names: stack W_query/W_key/W_value into W_qkv.
        self._register_load_state_dict_pre_hook(self._fuse_qkv)
"""),
                ("""        queries = self.W_query(x)  # (b, num_tokens, d_out)
        keys = self.W_key(x)
        values = self.W_value(x)
""", """        queries, keys, values = self.W_qkv(x).split(self.d_out, dim=-1)
"""),
                ("""    def forward(self, x):
        # Project, split""", """    @staticmethod
    def _fuse_qkv(state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{n}.{kind}" for n in ("W_query", "W_key", "W_value")]
            if all(n in state_dict for n in names):
                state_dict[f"{prefix}W_qkv.{kind}"] = torch.cat([state_dict.pop(n) for n in names])

    def forward(self, x):
        # Project, split""")),
               "one fused projection that loads the documented state_dict through a pre-hook"),
    Submission("logsumexp_softmax", S02,
               (("""    shifted = x - x.max(dim=dim, keepdim=True).values
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)""",
                 """    return torch.exp(x - torch.logsumexp(x, dim=dim, keepdim=True))"""),),
               "stable softmax through logsumexp"),
    Submission("stacked_heads", S09,
               (("torch.cat([head(x) for head in self.heads], dim=-1)",
                 "torch.stack([head(x) for head in self.heads], dim=-2).flatten(-2)"),),
               "stack the heads and flatten instead of cat"),
    Submission("bernoulli_dropout", S07,
               (("    keep = torch.rand_like(x) >= p\n    return x * keep / (1 - p)",
                 "    keep = torch.bernoulli(torch.full_like(x, 1 - p))\n    return x * keep / (1 - p)"),),
               "dropout mask drawn with torch.bernoulli"),
    Submission("where_instead_of_masked_fill", S06,
               (("masked = attn_scores.masked_fill(mask, -torch.inf)",
                 "masked = torch.where(mask, torch.full_like(attn_scores, float('-inf')), attn_scores)"),),
               "torch.where instead of masked_fill"),
    Submission("multiply_by_inverse_sqrt", S04,
               (("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores * d_k**-0.5, dim=-1)"),),
               "multiplying by d_k ** -0.5"),
    Submission("chunk_and_bool_mask", S11,
               (("queries, keys, values = qkv.split(self.d_out, dim=2)",
                 "queries, keys, values = qkv.chunk(3, dim=-1)"),
                ('self.register_buffer("mask", mask.view(1, 1, context_length, context_length))',
                 'self.register_buffer("mask", mask.bool().view(1, 1, context_length, context_length), '
                 'persistent=False)')),
               "chunk instead of split, a boolean non-persistent mask"),
]

# ---------------------------------------------------------------- modern-attention
M01, M02, M03, M04 = "m01_pytorch_attention", "m02_padding_and_cross", "m03_kv_cache", "m04_grouped_query"
M05, M06, M07 = "m05_rotary_embeddings", "m06_sliding_window", "m07_tiled_attention"

BUGS += [
    # m01_pytorch_attention
    Submission("sdpa_given_the_future_mask", M01,
               (("allowed = ~mha.mask.bool()[:num_tokens, :num_tokens]",
                 "allowed = mha.mask.bool()[:num_tokens, :num_tokens]"),),
               "F.scaled_dot_product_attention given chapter 3's mask as it is (True = the future, masked out)",
               "True where a token takes part"),
    Submission("torch_mha_given_the_sdpa_mask", M01,
               (("attn_mask=future, need_weights=False", "attn_mask=~future, need_weights=False"),),
               "nn.MultiheadAttention given the allowed positions (SDPA's convention; its own is True = masked out)",
               "True where a key is NOT allowed"),
    Submission("sdpa_queries_prescaled", M01,
               (("F.scaled_dot_product_attention(queries, keys",
                 "F.scaled_dot_product_attention(queries / mha.head_dim**0.5, keys"),),
               "the queries are divided by sqrt(head_dim) before SDPA, which scales them again", "scaled twice"),
    Submission("sdpa_not_causal", M01, (("is_causal=True", "is_causal=False"),),
               "SDPA called without is_causal=True: tokens see the future",
               "causal mask is missing or, as written, has no effect"),
    Submission("sdpa_dropout_in_eval_mode", M01,
               (("dropout_p = mha.dropout.p if mha.training else 0.0", "dropout_p = mha.dropout.p"),),
               "SDPA's dropout_p passed in eval mode too", "In eval mode dropout must do nothing"),
    Submission("in_proj_keys_first", M01,
               (("projections = (mha.W_query, mha.W_key, mha.W_value)",
                 "projections = (mha.W_key, mha.W_query, mha.W_value)"),),
               "in_proj_weight stacks the key weights before the query weights",
               "stack W_query, W_key and W_value in this order"),
    # m02_padding_and_cross
    Submission("empty_rows_give_nan", M02,
               (("    attn_weights = attn_weights.masked_fill(nothing_to_attend, 0.0)\n", ""),),
               "a query with every key masked keeps the NaN of its softmax row", "got NaN"),
    Submission("padding_mask_inverted", M02,
               (("allowed & key_padding_mask.bool()[:, None, None, :]",
                 "allowed & ~key_padding_mask.bool()[:, None, None, :]"),),
               "key_padding_mask read as True = padding (nn.MultiheadAttention's convention)",
               "key_padding_mask is inverted"),
    Submission("padding_mask_on_query_axis", M02,
               (("key_padding_mask.bool()[:, None, None, :]", "key_padding_mask.bool()[:, None, :, None]"),),
               "the padding mask hides query rows instead of key columns", "sat on the query axis",
               not_said=("cut it to the sequence",)),
    Submission("large_negative_fill_keeps_empty_rows", M02,
               (("attn_scores.masked_fill(~allowed, -torch.inf)", "attn_scores.masked_fill(~allowed, -1e9)"),
                ("    attn_weights = attn_weights.masked_fill(nothing_to_attend, 0.0)\n", "")),
               "masked with -1e9 (no NaN), so a query with nothing to attend to averages every value, padding "
               "included", "spreads its weight evenly"),
    # m03_kv_cache
    Submission("cache_positions_off_by_one", M03,
               (("start = num_keys - num_new  # the position of the first new token",
                 "start = num_keys - num_new + 1  # the position of the first new token"),),
               "the new tokens' positions are counted one too far: each new query also sees the next token",
               "one position late",
               not_said=("cut it to the sequence",)),
    Submission("cache_read_before_appending", M03,
               (("""            else:
                self.cache_k = torch.cat([self.cache_k, keys], dim=2)
                self.cache_v = torch.cat([self.cache_v, values], dim=2)
            keys, values = self.cache_k, self.cache_v
""", """            else:
                past_k, past_v = self.cache_k, self.cache_v
                self.cache_k = torch.cat([self.cache_k, keys], dim=2)
                self.cache_v = torch.cat([self.cache_v, values], dim=2)
                keys, values = past_k, past_v
"""),),
               "a cached step attends to the cache as it was before its own keys were appended: no new token sees "
               "itself", "before this step's keys and values were appended"),
    Submission("cache_mask_not_offset", M03,
               (("future = self.mask[start:start + num_new, :num_keys]", "future = self.mask[:num_new, :num_keys]"),),
               "the mask's rows start at 0 at every step: a single new token sees only the first key",
               "not offset by the cache length"),
    Submission("cache_mask_cut_to_new_tokens", M03,
               (("future = self.mask[start:start + num_new, :num_keys]", "future = self.mask[:num_new, :num_new]"),),
               "the mask is cut for the new tokens alone, as a nanoGPT-style forward cuts its buffer to x's length: "
               "right for single tokens (a 1 x 1 mask broadcasts), an error for a chunk after cached tokens",
               "sized for the new tokens alone", source="KV caches added to nanoGPT-style modules (bias[:, :, :T, :T])",
               not_said=("cut it to the sequence",)),
    Submission("cache_sdpa_causal_for_chunks", M03,
               (("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n"),
                ("""        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        future = self.mask[start:start + num_new, :num_keys]  # (num_new, num_keys), True = a later position
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values  # (b, num_heads, num_new, head_dim)
""", """        # A prompt needs the causal mask; a single new token may see every key.
        context_vec = F.scaled_dot_product_attention(queries, keys, values, is_causal=num_new > 1,
                                                     dropout_p=self.dropout.p if self.training else 0.0)
""")),
               "F.scaled_dot_product_attention with is_causal for prompts and off for single tokens: its diagonal is "
               "aligned top-left, wrong for a chunk of several tokens after cached ones",
               "aligns the diagonal top-left",
               source="text-generation-inference's causal prefill / non-causal decode; pytorch/pytorch#144858"),
    Submission("reset_cache_does_nothing", M03,
               (("        self.cache_k, self.cache_v = None, None\n", "        pass\n"),),
               "reset_cache leaves the cache full: the next sequence attends to the previous one's tokens",
               "the cache was not reset"),
    Submission("cache_overwritten", M03,
               (("self.cache_k = torch.cat([self.cache_k, keys], dim=2)", "self.cache_k = keys"),
                ("self.cache_v = torch.cat([self.cache_v, values], dim=2)", "self.cache_v = values")),
               "each step replaces the cache with its new tokens instead of appending them",
               "attended to its own new tokens only"),
    # m04_grouped_query
    Submission("gqa_repeat_instead_of_repeat_interleave", M04,
               (("keys = keys.repeat_interleave(self.group_size, dim=1)",
                 "keys = keys.repeat(1, self.group_size, 1, 1)"),
                ("values = values.repeat_interleave(self.group_size, dim=1)",
                 "values = values.repeat(1, self.group_size, 1, 1)")),
               "the kv heads tiled with repeat: query head h gets kv head h % num_kv_groups, not h // group_size",
               "expanded with `repeat`"),
    Submission("gqa_kv_as_wide_as_queries", M04,
               (("nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)",
                 "nn.Linear(d_in, d_out, bias=qkv_bias)"),
                ("self.split_heads(self.W_key(x), self.num_kv_groups)",
                 "self.split_heads(self.W_key(x), self.num_heads)"),
                ("self.split_heads(self.W_value(x), self.num_kv_groups)",
                 "self.split_heads(self.W_value(x), self.num_heads)"),
                ("        keys = keys.repeat_interleave(self.group_size, dim=1)\n"
                 "        values = values.repeat_interleave(self.group_size, dim=1)\n", "")),
               "keys and values keep num_heads heads: multi-head attention, no smaller projections or cache",
               "keys and values get num_kv_groups heads, not num_heads"),
    Submission("gqa_cache_of_expanded_heads", M04,
               (("self.split_heads(self.W_key(x), self.num_kv_groups)",
                 "self.split_heads(self.W_key(x), self.num_kv_groups).repeat_interleave(self.group_size, dim=1)"),
                ("self.split_heads(self.W_value(x), self.num_kv_groups)",
                 "self.split_heads(self.W_value(x), self.num_kv_groups).repeat_interleave(self.group_size, dim=1)"),
                ("        keys = keys.repeat_interleave(self.group_size, dim=1)\n"
                 "        values = values.repeat_interleave(self.group_size, dim=1)\n", "")),
               "the kv heads expanded before the cache: right outputs, a cache as large as multi-head attention's",
               "expand them after the cache"),
    # m05_rotary_embeddings
    Submission("rope_on_values", M05,
               (("        keys = apply_rope(keys, self.cos, self.sin, offset)\n",
                 "        keys = apply_rope(keys, self.cos, self.sin, offset)\n"
                 "        values = apply_rope(values, self.cos, self.sin, offset)\n"),),
               "the values are rotated too", "RoPE was applied to the values"),
    Submission("rope_interleaved_pairs", M05,
               (("    x1, x2 = x.chunk(2, dim=-1)  # first and second halves, (b, heads, num_tokens, head_dim/2) each\n"
                 "    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half(x)\n"
                 "    return x * cos + rotated * sin\n",
                 "    half = x.shape[-1] // 2\n"
                 "    x1, x2 = x[..., ::2], x[..., 1::2]  # neighbours (2i, 2i + 1), as in the RoFormer code\n"
                 "    c, s = cos[..., :half], sin[..., :half]\n"
                 "    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)\n"),),
               "apply_rope rotates neighbouring features (2i, 2i + 1), the original RoPE layout, not Llama's halves",
               "where Llama's halves layout is meant"),
    Submission("rope_mixed_layouts", M05,
               (("angles = torch.cat([freqs, freqs], dim=-1)", "angles = freqs.repeat_interleave(2, dim=-1)"),),
               "rope_angles lays the angles out interleaved while apply_rope pairs the halves (rotate_half)",
               "cos and sin are in the interleaved layout"),
    Submission("rope_positions_restart", M05,
               (("offset = self.cache_k.shape[2] if use_cache and self.cache_k is not None else 0", "offset = 0"),),
               "cached steps rotate their tokens from position 0 again", "positions restart at 0"),
    Submission("rope_theta_ignored", M05,
               (("inv_freq = theta_base ** (-torch.arange", "inv_freq = 10_000.0 ** (-torch.arange"),),
               "rope_angles always uses 10_000 as theta_base", "theta_base was ignored"),
    # m06_sliding_window
    Submission("window_off_by_one", M06,
               (("return (j <= i) & (i - j < window)", "return (j <= i) & (i - j <= window)"),),
               "the window lets window + 1 tokens take part", "the window is off by one: i - j <= window"),
    Submission("window_cache_not_bounded", M06,
               (("self.cache_k, self.cache_v = keys[:, :, -self.window:], values[:, :, -self.window:]",
                 "self.cache_k, self.cache_v = keys, values"),),
               "the cache keeps every position (the outputs stay right, the memory grows)", "the cache is not bounded"),
    Submission("window_cache_keeps_oldest", M06,
               (("[:, :, -self.window:]", "[:, :, :self.window]"),),
               "the cache keeps the first window positions instead of the last", "kept the OLDEST window positions"),
    Submission("window_cache_cut_before_attending", M06,
               (("""            self.cache_k, self.cache_v = keys[:, :, -self.window:], values[:, :, -self.window:]
            allowed = self.band[num_cached:num_cached + num_new, :num_cached + num_new]  # (num_new, num_keys)
""", """            # No query reaches further back than the window: keep (and attend to) its last positions only.
            keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
            self.cache_k, self.cache_v = keys, values
            num_keys = keys.shape[2]
            # The kept keys end with the new tokens: each new query sees the kept keys up to its own.
            allowed = torch.ones(num_new, num_keys, dtype=torch.bool, device=x.device).tril(num_keys - num_new)
"""),),
               "the cache is cut to the window before the new queries attend: a chunk's earlier queries lose keys "
               "they must see (a chunk longer than the window leaves some with none)", "cut to the last",
               source="Hugging Face transformers' sliding-window cache returning the cut states at prefill "
                      "(huggingface/transformers#30642)",
               not_said=("the window is off by one",)),
    Submission("window_rows_not_offset", M06,
               (("allowed = self.band[num_cached:num_cached + num_new, :num_cached + num_new]",
                 "allowed = self.band[:num_new, :num_cached + num_new]"),),
               "cached steps take the band's first rows for the new queries", "took the band's first rows"),
    # m07_tiled_attention
    Submission("tiled_max_starts_at_zero", M07,
               (("row_max = torch.full((*q_blk.shape[:-1], 1), -torch.inf, dtype=work, device=q.device)",
                 "row_max = torch.zeros((*q_blk.shape[:-1], 1), dtype=work, device=q.device)"),),
               "the running max starts at 0: rows whose scores are all far below 0 underflow",
               "running max started at 0"),
    Submission("tiled_max_not_carried", M07,
               (("new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))",
                 "new_max = s.amax(dim=-1, keepdim=True)"),),
               "the new max is the tile's alone: exact until exp(old max - new max) overflows on large logits",
               "running max was not carried"),
    Submission("tiled_sum_not_rescaled", M07,
               (("row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)",
                 "row_sum = row_sum + p.sum(dim=-1, keepdim=True)"),),
               "the running sum is not rescaled when the max grows", "running sum row_sum was not rescaled"),
    Submission("tiled_acc_not_rescaled", M07,
               (("acc = acc * correction + p @ v_blk", "acc = acc + p @ v_blk"),),
               "the accumulator is not rescaled when the max grows", "accumulator acc was not rescaled"),
    Submission("tiled_full_score_matrix", M07,
               (("    out = torch.empty_like(q)\n",
                 "    scores = (q @ k.transpose(-2, -1)) * scale  # (b, num_heads, n_q, n_kv): what tiling avoids\n"
                 "    if is_causal:\n"
                 "        keep = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril()\n"
                 "        scores = scores.masked_fill(~keep, -torch.inf)\n"
                 "    return torch.softmax(scores, dim=-1) @ v\n"),),
               "right output, computed from the full score matrix", "full score matrix was materialised"),
    Submission("tiled_calls_sdpa", M07,
               (("    out = torch.empty_like(q)\n",
                 "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)\n"),),
               "right output, from the fused kernel the stage explains", "called F.scaled_dot_product_attention"),
    Submission("tiled_mask_at_full_tile_size", M07,
               (("    out = torch.empty_like(q)\n",
                 "    out = torch.empty_like(q)\n"
                 "    # The mask of a tile on the diagonal, built once: key column c is after query row r when c > r.\n"
                 "    diagonal = torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).triu(1)\n"),
                ("""                cols = torch.arange(k_start, k_end, device=q.device)  # key positions, (bk,)
                s = s.masked_fill(cols > rows, -torch.inf)  # a key after its query takes no part
""", """                if k_start == q_start:  # tiles left of the diagonal need no mask
                    s = s.masked_fill(diagonal, -torch.inf)
""")),
               "the diagonal tile's mask is built once at block_size x block_size: it does not fit the shorter last "
               "tile", "sized for a full tile",
               source="pure-PyTorch FlashAttention ports that precompute one block-sized causal mask",
               not_said=("cut it to the sequence",)),
    Submission("tiled_mask_bottom_right_tiles_top_left", M07,
               (("s = s.masked_fill(cols > rows, -torch.inf)",
                 "s = s.masked_fill(cols > rows + (n_kv - n_q), -torch.inf)  # the last query sees every key"),),
               "the mask aligned bottom-right (FlashAttention 2.1's convention when n_q != n_kv) while the tiles "
               "are skipped top-left: right when n_q == n_kv, otherwise neither alignment", "causal mask is misaligned",
               source="FlashAttention 2.1's change to bottom-right causal alignment (Dao-AILab/flash-attention)"),
    Submission("tiled_nan_from_masked_rows", M07,
               (("kv_end = min(n_kv, q_end) if is_causal else n_kv", "kv_end = n_kv"),
                ("for k_start in range(0, kv_end, block_size):",
                 "for k_start in reversed(range(0, kv_end, block_size)):"),
                ("shift = torch.where(new_max == -torch.inf, 0.0, new_max)", "shift = new_max")),
               "every key tile, last to first, masked tiles included: a row with all scores masked so far "
               "computes exp(-inf - (-inf)) = NaN", "subtract 0 there",
               not_said=("causal mask is misaligned",)),
]

VARIANTS += [
    # m01_pytorch_attention
    Submission("sdpa_additive_float_mask", M01,
               (("allowed = ~mha.mask.bool()[:num_tokens, :num_tokens]",
                 "allowed = torch.zeros(num_tokens, num_tokens, dtype=queries.dtype, device=queries.device)\n"
                 "        allowed = allowed.masked_fill(mha.mask.bool()[:num_tokens, :num_tokens], -torch.inf)"),),
               "SDPA with an additive float mask (0 = takes part, -inf = masked out) instead of a boolean one"),
    Submission("torch_mha_float_causal_mask", M01,
               (("out, _ = torch_mha(x, x, x, attn_mask=future, need_weights=False)",
                 "future = nn.Transformer.generate_square_subsequent_mask(num_tokens, device=x.device, dtype=x.dtype)\n"
                 "    out, _ = torch_mha(x, x, x, attn_mask=future, need_weights=False, is_causal=True)"),),
               "nn.MultiheadAttention with nn.Transformer's float causal mask and the is_causal hint"),
    # m02_padding_and_cross
    Submission("empty_rows_by_nan_to_num", M02,
               (("    nothing_to_attend = ~allowed.any(dim=-1, keepdim=True)  # (..., n_q, 1)\n"
                 "    attn_weights = attn_weights.masked_fill(nothing_to_attend, 0.0)\n",
                 "    attn_weights = attn_weights.nan_to_num(0.0)  # NaN rows: those with nothing to attend to\n"),),
               "fully masked rows zeroed by nan_to_num after the softmax instead of masked_fill"),
    Submission("empty_rows_by_where", M02,
               (("attn_weights = attn_weights.masked_fill(nothing_to_attend, 0.0)",
                 "attn_weights = torch.where(nothing_to_attend, torch.zeros_like(attn_weights), attn_weights)"),),
               "fully masked rows zeroed with torch.where"),
    Submission("large_negative_fill_and_zeroed_rows", M02,
               (("attn_scores.masked_fill(~allowed, -torch.inf)",
                 "attn_scores.masked_fill(~allowed, torch.finfo(attn_scores.dtype).min)"),),
               "masked with the dtype's most negative number (no -inf), fully masked rows still zeroed"),
    # m03_kv_cache
    Submission("preallocated_cache_with_position", M03,
               (('        self.register_buffer("cache_k", None, persistent=False)\n'
                 '        self.register_buffer("cache_v", None, persistent=False)\n',
                 "        self.reset_cache()\n"),
                ("    def reset_cache(self):", """    @property
    def cache_k(self):
        return None if self.k_buffer is None else self.k_buffer[:, :, :self.position]

    @property
    def cache_v(self):
        return None if self.v_buffer is None else self.v_buffer[:, :, :self.position]

    def reset_cache(self):"""),
                ("self.cache_k, self.cache_v = None, None",
                 "self.k_buffer, self.v_buffer, self.position = None, None, 0"),
                ("""            if self.cache_k is None:
                self.cache_k, self.cache_v = keys, values
            else:
                self.cache_k = torch.cat([self.cache_k, keys], dim=2)
                self.cache_v = torch.cat([self.cache_v, values], dim=2)
""", """            b, _, num_new, _ = keys.shape
            if self.k_buffer is None:  # room for a whole context, allocated once
                shape = (b, self.num_heads, self.mask.shape[0], self.head_dim)
                self.k_buffer, self.v_buffer = keys.new_empty(shape), values.new_empty(shape)
            end = self.position + num_new
            self.k_buffer[:, :, self.position:end] = keys
            self.v_buffer[:, :, self.position:end] = values
            self.position = end
""")),
               "a cache buffer allocated once for the whole context, filled up to a position counter"),
    Submission("mask_from_positions", M03,
               (("future = self.mask[start:start + num_new, :num_keys]",
                 "positions = torch.arange(num_keys, device=x.device)\n"
                 "        future = positions[None, :] > positions[start:, None]"),),
               "the causal mask compared from the positions of the new queries and of the keys"),
    # m04_grouped_query
    Submission("gqa_expand_and_reshape", M04,
               (("keys = keys.repeat_interleave(self.group_size, dim=1)",
                 "keys = keys[:, :, None].expand(-1, -1, self.group_size, -1, -1).flatten(1, 2)"),
                ("values = values.repeat_interleave(self.group_size, dim=1)",
                 "values = values[:, :, None].expand(-1, -1, self.group_size, -1, -1).flatten(1, 2)")),
               "expand a new group axis and merge it into the head axis instead of repeat_interleave"),
    Submission("gqa_sdpa_enable_gqa", M04,
               (("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n"),
                ("        keys = keys.repeat_interleave(self.group_size, dim=1)\n"
                 "        values = values.repeat_interleave(self.group_size, dim=1)\n", ""),
                ("num_keys = keys.shape[2]",
                 "num_keys = keys.shape[2]\n        dropout_p = self.dropout.p if self.training else 0.0"),
                ("""        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        future = self.mask[start:start + num_new, :num_keys]  # (num_new, num_keys), True = a later position
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values  # (b, num_heads, num_new, head_dim)
""", """        future = self.mask[start:start + num_new, :num_keys]  # (num_new, num_keys), True = a later position
        context_vec = F.scaled_dot_product_attention(queries, keys, values, attn_mask=~future, dropout_p=dropout_p,
                                                     enable_gqa=True)
""")),
               "F.scaled_dot_product_attention(enable_gqa=True) on the num_kv_groups heads, no explicit expansion"),
    # m05_rotary_embeddings
    Submission("rope_complex_halves", M05,
               (("    x1, x2 = x.chunk(2, dim=-1)  # first and second halves, (b, heads, num_tokens, head_dim/2) each\n"
                 "    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half(x)\n"
                 "    return x * cos + rotated * sin\n",
                 "    half = x.shape[-1] // 2\n"
                 "    wide = torch.promote_types(x.dtype, torch.float32)  # complex parts: float32/float64\n"
                 "    pairs = torch.complex(x[..., :half].to(wide), x[..., half:].to(wide))  # x[i] + 1j x[i + half]\n"
                 "    turned = pairs * torch.complex(cos[..., :half].to(wide), sin[..., :half].to(wide))\n"
                 "    return torch.cat([turned.real, turned.imag], dim=-1).to(x.dtype)\n"),),
               "RoPE as a product with e^(1j angle) of the complex numbers x[i] + 1j x[i + head_dim/2] (halves)"),
    # m06_sliding_window
    Submission("window_mask_from_tril", M06,
               (("    i = torch.arange(num_tokens)[:, None]  # (num_tokens, 1)\n"
                 "    j = torch.arange(num_tokens)[None, :]  # (1, num_tokens)\n"
                 "    return (j <= i) & (i - j < window)\n",
                 "    ones = torch.ones(num_tokens, num_tokens, dtype=torch.bool)\n"
                 "    return torch.tril(ones) & ~torch.tril(ones, diagonal=-window)\n"),),
               "the band as the causal triangle minus the triangle window or more positions back"),
    # m07_tiled_attention
    Submission("tiled_exp2", M07,
               (("q_blk = q[..., q_start:q_end, :].to(work) * scale",
                 "q_blk = q[..., q_start:q_end, :].to(work) * (scale * math.log2(math.e))"),
                ("p = torch.exp(s - shift)", "p = torch.exp2(s - shift)"),
                ("correction = torch.exp(row_max - shift)", "correction = torch.exp2(row_max - shift)")),
               "exp2 with log2(e) folded into the scale, as the fused kernels do"),
    Submission("tiled_masked_tiles_last_to_first", M07,
               (("kv_end = min(n_kv, q_end) if is_causal else n_kv", "kv_end = n_kv"),
                ("for k_start in range(0, kv_end, block_size):",
                 "for k_start in reversed(range(0, kv_end, block_size)):")),
               "every key tile, last to first: tiles above the diagonal masked, not skipped"),
]

# ---------------------------------------------------------------- frontier-attention
F01, F02, F03, F04 = "f01_latent_attention", "f02_attention_sinks", "f03_paged_kv_cache", "f04_flex_attention"
F05, F06, F07 = "f05_sparse_indexer", "f06_gated_delta_rule", "f07_cross_layer_kv"


# (what f03's feedback said once, on any error of two checks, whether the error had anything to do with freeing)
NOT_RETURNED = "give the sequence's blocks back to the free list"


def sample_edits(student: str, stage: str) -> tuple:
    """The edits of the demo's sample ``student`` to ``stage`` (assignments/<name>/samples.py): a mistake that is
    both a sample and a catalogue entry."""
    return tuple(by_student(student, assignment_of(stage)).edits[stage])


BUGS += [
    # f01_latent_attention
    Submission("mla_scaled_by_head_dim", F01,
               (("torch.softmax(attn_scores / (self.head_dim + self.rope_dim) ** 0.5, dim=-1)",
                 "torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1)"),),
               "the scores scaled by 1/sqrt(head_dim), as in multi-head attention, in both forms",
               "scaled by 1/sqrt(head_dim)"),
    Submission("mla_latent_not_normalised", F01,
               (("return self.kv_norm(self.W_kv_down(x)),", "return self.W_kv_down(x),"),),
               "the latent cached and expanded without kv_norm", "kv_norm is missing or, as written, has no effect"),
    Submission("mla_positions_restart", F01, sample_edits("mla-positions-restart", F01),
               "every cached step rotates its tokens from position 0", "positions restart at 0"),
    Submission("mla_no_rotary_score", F01,
               (("        attn_scores = attn_scores + q_rope @ k_rope.unsqueeze(1).transpose(2, 3)  # (b, 1, rope_dim, "
                 "num_keys)\n", ""),
                ("        attn_scores = attn_scores + q_rope @ k_rope.unsqueeze(1).transpose(2, 3)\n", "")),
               "the decoupled rotary part of the scores left out: content scores only", "rotary part of the scores"),
    Submission("mla_up_projection_split_by_columns", F01,
               (("self.W_key_up.weight.view(self.num_heads, self.head_dim, self.kv_latent_dim)",
                 "self.W_key_up.weight.view(self.head_dim, self.num_heads, self.kv_latent_dim).transpose(0, 1)"),
                ("self.W_value_up.weight.view(self.num_heads, self.head_dim, self.kv_latent_dim)",
                 "self.W_value_up.weight.view(self.head_dim, self.num_heads, self.kv_latent_dim).transpose(0, 1)")),
               "the absorbed form takes head h's rows of the up-projections as every num_heads-th row",
               "split into heads the wrong way"),
    Submission("mla_cache_bytes_latent_twice", F01,
               (("return (kv_latent_dim + rope_dim) * num_layers * bytes_per_element",
                 "return 2 * (kv_latent_dim + rope_dim) * num_layers * bytes_per_element"),),
               "the latent counted twice, once for the keys and once for the values", "the latent was counted twice"),
    # f02_attention_sinks
    Submission("sinks_left_out", F02,
               (("total = exps.sum(dim=-1, keepdim=True) + torch.exp(sinks - row_max)",
                 "total = exps.sum(dim=-1, keepdim=True)"),),
               "softmax_with_sinks is a plain softmax: the sink logits never reach the denominator",
               "the sink logits were left out"),
    Submission("sink_logits_scaled", F02,
               (("attn_scores = queries @ keys.transpose(2, 3) / self.head_dim**0.5",
                 "attn_scores = queries @ keys.transpose(2, 3)"),
                ("return softmax_with_sinks(attn_scores, self.sinks) @ values",
                 "scale = self.head_dim**0.5\n"
                 "        return softmax_with_sinks(attn_scores / scale, self.sinks / scale) @ values")),
               "the sink logits divided by sqrt(head_dim) together with the scores", "sink logits were scaled"),
    Submission("sink_window_off_by_one", F02,
               (("allowed = allowed & ((j < num_sink_tokens) | (i - j < window))",
                 "allowed = allowed & ((j < num_sink_tokens) | (i - j <= window))"),),
               "the window lets window + 1 tokens take part", "the window is off by one"),
    Submission("sink_tokens_evicted", F02,
               (("keep = (key_positions < self.num_sink_tokens) | (key_positions[-1] - key_positions < self.window)",
                 "keep = key_positions[-1] - key_positions < self.window"),),
               "the cache keeps the last window positions only: the sink tokens leave it like any other",
               "sink tokens were evicted from the cache"),
    Submission("sink_softmax_without_max", F02,
               (("row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # (b, num_heads, n_q, 1)",
                 "row_max = torch.zeros_like(scores[..., :1])"),),
               "exp of the raw logits: right until a score or a sink logit is large enough to overflow",
               "exp overflowed"),
    # f03_paged_kv_cache
    Submission("paged_whole_blocks", F03,
               (("return blocks.transpose(0, 1).reshape(self.num_heads, -1, self.head_dim)[:, :length]",
                 "return blocks.transpose(0, 1).reshape(self.num_heads, -1, self.head_dim)"),),
               "gather returns whole blocks: unwritten or stale slots join the keys",
               "not cut at the sequence's length"),
    Submission("paged_blocks_without_transpose", F03,
               (("return blocks.transpose(0, 1).reshape(self.num_heads, -1, self.head_dim)[:, :length]",
                 "return blocks.reshape(self.num_heads, -1, self.head_dim)[:, :length]"),),
               "the gathered blocks reshaped to (num_heads, tokens, head_dim) without moving the head axis first",
               "without moving the head axis first"),
    Submission("paged_new_block_every_step", F03,
               (("        while len(table) * self.block_size < length:\n",
                 "        table.append(self.free_blocks.pop(0))  # a fresh block for the new tokens\n"
                 "        while len(table) * self.block_size < length:\n"),),
               "a block taken at every step, the last one's free slots left empty", "a new block was taken",
               not_said=(NOT_RETURNED,)),
    Submission("paged_free_keeps_blocks", F03, sample_edits("paged-blocks-lost", F03),
               "free() forgets the table but never returns its blocks: the pool runs dry",
               "give the sequence's blocks back to the free list"),
    Submission("paged_free_keeps_table", F03,
               (("self.free_blocks.extend(self.block_tables.pop(seq_id))",
                 "self.free_blocks.extend(self.block_tables[seq_id])"),),
               "free() returns the blocks but keeps the table: the id's next sequence writes into blocks others get",
               "free() kept the sequence's block table", not_said=(NOT_RETURNED,)),
    Submission("paged_written_from_position_zero", F03,
               (("        start = self.seq_lens[seq_id]\n", "        start = 0\n"),),
               "every step writes its tokens from position 0 and counts only them", "wrote its keys from position 0"),
    # f04_flex_attention
    Submission("flex_causal_strict", F04, (("    return q_idx >= kv_idx\n", "    return q_idx > kv_idx\n"),),
               "the causal mask_mod leaves out the diagonal", "the diagonal was masked"),
    Submission("flex_window_both_ways", F04, sample_edits("flex-window-both-ways", F04),
               "the sliding window as a distance both ways: it sees the next window - 1 tokens too",
               "the window is not causal"),
    Submission("flex_alibi_bonus", F04,
               (("return score - slopes[h] * (q_idx - kv_idx)", "return score + slopes[h] * (q_idx - kv_idx)"),),
               "ALiBi's bias added with the wrong sign: distant tokens get a bonus",
               "the ALiBi bias has the wrong sign"),
    Submission("flex_alibi_one_geometric_sequence", F04,
               (("slopes = geometric(n) + geometric(2 * n)[0::2][:num_heads - n]", "slopes = geometric(num_heads)"),),
               "the power-of-2 formula used for every head count", "the slopes follow the ALiBi paper's rule"),
    Submission("flex_soft_cap_without_division", F04,
               (("return cap * torch.tanh(score / cap)", "return cap * torch.tanh(score)"),),
               "soft-capping as cap * tanh(score)", "the score was not divided by cap"),
    Submission("flex_documents_not_causal", F04,
               (("return (document_ids[q_idx] == document_ids[kv_idx]) & (q_idx >= kv_idx)",
                 "return document_ids[q_idx] == document_ids[kv_idx]"),),
               "the document mask alone: a token sees the later tokens of its document",
               "the document mask must be causal"),
    # f05_sparse_indexer
    Submission("indexer_without_relu", F05,
               (("torch.einsum(\"bth,bths->bts\", head_weights, torch.relu(dots))",
                 "torch.einsum(\"bth,bths->bts\", head_weights, dots)"),),
               "the indexer heads' dot products summed without the ReLU", "the ReLU is missing"),
    Submission("indexer_heads_unweighted", F05,
               (("torch.einsum(\"bth,bths->bts\", head_weights, torch.relu(dots))",
                 "torch.relu(dots).sum(dim=2)"),),
               "the indexer heads summed without their per-token weights", "summed without their weights"),
    Submission("top_k_before_the_mask", F05,
               (("        return scores.masked_fill(self.mask[:num_tokens, :num_tokens], -torch.inf)\n",
                 "        return scores\n"),),
               "top-k over every key, the future masked only afterwards: early queries keep fewer keys",
               "the top-k was taken before the future was masked"),
    Submission("top_k_smallest", F05,
               (("best = scores.topk(min(self.top_k, num_tokens), dim=-1).indices",
                 "best = scores.masked_fill(scores == -torch.inf, torch.inf)"
                 ".topk(min(self.top_k, num_tokens), dim=-1, largest=False).indices"),),
               "the lowest index scores kept", "the keys with the LOWEST index scores were kept"),
    Submission("sparse_selection_ignored", F05,
               (("attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(~chosen, -torch.inf)",
                 "attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(self.mask[:num_tokens, :num_tokens], "
                 "-torch.inf)"),),
               "the selection computed, the attention left dense and causal", "the attention ignores the selection"),
    # f06_gated_delta_rule
    Submission("delta_rule_normalised_over_dim_1", F06,
               (("q = F.normalize(heads(self.W_query(x)), dim=-1)", "q = F.normalize(heads(self.W_query(x)))"),
                ("k = F.normalize(heads(self.W_key(x)), dim=-1)", "k = F.normalize(heads(self.W_key(x)))")),
               "F.normalize without dim: its default dim=1 is the head axis", "normalised over the head axis"),
    Submission("delta_rule_without_the_correction", F06,
               (("update = beta[..., t, None] * (v[..., t, :] - predicted)  # (b, h, d_v)",
                 "update = beta[..., t, None] * v[..., t, :]  # (b, h, d_v)"),),
               "the recurrence writes beta v_t: gated linear attention, not the delta rule",
               "the delta rule's correction is missing"),
    Submission("delta_rule_decays_after_writing", F06,
               (("""        state = state * torch.exp(g[..., t])[..., None, None]  # forget
        predicted = (k[..., t, :, None] * state).sum(dim=-2)  # (b, h, d_v): what S holds for k_t
        update = beta[..., t, None] * (v[..., t, :] - predicted)  # (b, h, d_v)
        state = state + k[..., t, :, None] * update[..., None, :]  # + k_t u_t^T
""", """        predicted = (k[..., t, :, None] * state).sum(dim=-2)  # (b, h, d_v): what S holds for k_t
        update = beta[..., t, None] * (v[..., t, :] - predicted)  # (b, h, d_v)
        state = state + k[..., t, :, None] * update[..., None, :]  # + k_t u_t^T
        state = state * torch.exp(g[..., t])[..., None, None]  # forget
"""),),
               "the recurrent form forgets after the write", "decayed after the update"),
    Submission("delta_rule_reads_before_writing", F06,
               (("""        state = state + k[..., t, :, None] * update[..., None, :]  # + k_t u_t^T
        out[..., t, :] = (q[..., t, :, None] * state).sum(dim=-2)  # q_t^T S
""", """        out[..., t, :] = (q[..., t, :, None] * state).sum(dim=-2)  # q_t^T S
        state = state + k[..., t, :, None] * update[..., None, :]  # + k_t u_t^T
"""),),
               "each token's output read from the state before its own write",
               "read the state before the token's write"),
    Submission("chunk_state_not_decayed", F06,
               (("return out, torch.exp(last)[..., None] * state + written", "return out, state + written"),),
               "the chunked form carries the state to the next chunk without the chunk's decay",
               "the state carried to the next chunk was not decayed"),
    Submission("chunk_diagonal_in_the_system", F06,
               (("a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower",
                 "a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril()"),
                ("system = a + torch.eye(size, dtype=v.dtype, device=v.device)", "system = a"),
                ("upper=False, unitriangular=True)", "upper=False)"),
                ("upper=False,\n                                      unitriangular=True)", "upper=False)")),
               "the triangular system built with beta_i (k_i . k_i) on its diagonal instead of 1",
               "the diagonal of beta_i (k_i . k_i) entered the triangular system"),
    # f07_cross_layer_kv
    Submission("cla_group_number_for_a_layer", F07,
               (("return [layer - layer % share_every for layer in range(num_layers)]",
                 "return [layer // share_every for layer in range(num_layers)]"),),
               "Cross-Layer Attention's source as the group's number instead of its first layer",
               "the group's index was taken for a layer"),
    Submission("shared_tail_points_at_itself", F07,
               (("return [layer if layer < first_shared else first_shared - 1 for layer in range(num_layers)]",
                 "return [layer if layer < first_shared else first_shared for layer in range(num_layers)]"),),
               "the shared layers read the first of them, which then computes its own",
               "the shared layers point at the first of them"),
    Submission("sharing_weights_not_keys", F07,
               (("            h = h + module(h, *shared[source])\n",
                 "            own = shared[source] if source == layer else self.layers[source].project_kv(h)\n"
                 "            h = h + module(h, *own)\n"),),
               "a reusing layer applies its source's W_key and W_value to its own input", "that shares weights"),
    Submission("reusing_layers_read_new_keys_only", F07,
               (("                keys, values = module.project_kv(h)  # (b, num_kv_groups, num_new, head_dim)\n",
                 "                keys, values = module.project_kv(h)  # (b, num_kv_groups, num_new, head_dim)\n"
                 "                fresh = keys, values\n"),
                ("            h = h + module(h, *shared[source])\n",
                 "            h = h + module(h, *(shared[source] if source == layer else fresh))\n")),
               "in cached steps a reusing layer attends to its source's new tokens only",
               "attended to its source's NEW keys only"),
    Submission("cache_bytes_of_every_layer", F07,
               (("computing = sum(source == layer for layer, source in enumerate(kv_sources))",
                 "computing = len(kv_sources)"),),
               "every layer counted in the cache's bytes, the reusing ones too", "every layer was counted"),
    Submission("reusing_layers_keep_key_weights", F07,
               (("        if computes_kv:\n            self.W_key", "        if True:\n            self.W_key"),),
               "every layer gets W_key and W_value, the reusing ones too: parameters that do nothing",
               "has no W_key or W_value"),
]

VARIANTS += [
    # f01_latent_attention
    Submission("mla_expanded_through_sdpa", F01,
               (("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n"),
                ("""        attn_scores = q_content @ keys.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        attn_scores = attn_scores + q_rope @ k_rope.unsqueeze(1).transpose(2, 3)  # (b, 1, rope_dim, num_keys)
        attn_scores = attn_scores.masked_fill(self.causal_mask(q_content.shape[2], latent.shape[1]), -torch.inf)
        attn_weights = torch.softmax(attn_scores / (self.head_dim + self.rope_dim) ** 0.5, dim=-1)
        return attn_weights @ values
""", """        # A head's key: its content key, then the shared rotary key. SDPA scales by 1/sqrt of that width.
        b, num_heads, num_keys, _ = keys.shape
        keys = torch.cat([keys, k_rope.unsqueeze(1).expand(b, num_heads, num_keys, self.rope_dim)], dim=-1)
        queries = torch.cat([q_content, q_rope], dim=-1)
        allowed = ~self.causal_mask(q_content.shape[2], num_keys)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed)
""")),
               "the expanded form as one SDPA call: content and rotary parts concatenated into each head's key"),
    Submission("mla_absorbed_by_einsum", F01,
               (("""        q_latent = q_content @ w_uk.unsqueeze(0)  # (b, num_heads, num_new, kv_latent_dim)
        latent = latent.unsqueeze(1)  # (b, 1, num_keys, kv_latent_dim): the same latents for every head
        attn_scores = q_latent @ latent.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        attn_scores = attn_scores + q_rope @ k_rope.unsqueeze(1).transpose(2, 3)
        attn_scores = attn_scores.masked_fill(self.causal_mask(q_content.shape[2], latent.shape[2]), -torch.inf)
        attn_weights = torch.softmax(attn_scores / (self.head_dim + self.rope_dim) ** 0.5, dim=-1)
        mixed = attn_weights @ latent  # (b, num_heads, num_new, kv_latent_dim)
        return mixed @ w_uv.transpose(1, 2).unsqueeze(0)  # (b, num_heads, num_new, head_dim)
""", """        q_latent = torch.einsum("bhnd,hdl->bhnl", q_content, w_uk)
        attn_scores = torch.einsum("bhnl,bkl->bhnk", q_latent, latent) + torch.einsum("bhnr,bkr->bhnk", q_rope, k_rope)
        attn_scores = attn_scores.masked_fill(self.causal_mask(q_content.shape[2], latent.shape[1]), -torch.inf)
        attn_weights = torch.softmax(attn_scores / (self.head_dim + self.rope_dim) ** 0.5, dim=-1)
        return torch.einsum("bhnk,bkl,hdl->bhnd", attn_weights, latent, w_uv)
"""),),
               "the absorbed form in three einsums (the last one lets torch choose the order of the products)"),
    # f02_attention_sinks
    Submission("sinks_as_an_extra_column", F02,
               (("""    sinks = sinks.view(-1, 1, 1).to(scores.dtype)  # (num_heads, 1, 1)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # (b, num_heads, n_q, 1)
    row_max = torch.where(row_max == -torch.inf, 0.0, row_max)  # nothing finite in the row: every exp is 0
    exps = torch.exp(scores - row_max)
    total = exps.sum(dim=-1, keepdim=True) + torch.exp(sinks - row_max)  # >= 1 unless the row has nothing
    return exps / torch.where(total == 0, 1.0, total)
""", """    # gpt-oss's way: the sink as one more column of logits, softmax, then drop that column.
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, column], dim=-1)
    empty = (logits == -torch.inf).all(dim=-1, keepdim=True)  # nothing to attend to, not even a sink
    weights = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return weights[..., :-1]
"""),),
               "the sink logit appended as an extra column, softmax, the column dropped (gpt-oss's eager code)"),
    Submission("streaming_mask_from_distances", F02,
               (("""    i, j = query_positions[:, None], key_positions[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & ((j < num_sink_tokens) | (i - j < window))
    return allowed
""", """    distance = query_positions[:, None] - key_positions[None, :]  # >= 0 for keys at or before the query
    if window is None:
        return distance >= 0
    is_sink = (key_positions < num_sink_tokens)[None, :]
    return (distance >= 0) & (is_sink | (distance <= window - 1))
"""),),
               "the mask written from the distances query - key, the window as distance <= window - 1"),
    # f03_paged_kv_cache
    Submission("paged_gather_by_slot", F03,
               (("""        def lay_out(pool):
            blocks = pool[table]  # (num_blocks_held, num_heads, block_size, head_dim)
            return blocks.transpose(0, 1).reshape(self.num_heads, -1, self.head_dim)[:, :length]

        return lay_out(self.k_pool), lay_out(self.v_pool)
""", """        positions = torch.arange(length, device=self.k_pool.device)  # every cached token, slot by slot
        blocks, slots = table[positions // self.block_size], positions % self.block_size
        return self.k_pool[blocks, :, slots].transpose(0, 1), self.v_pool[blocks, :, slots].transpose(0, 1)
"""),),
               "gather token by token through (block, slot) indices instead of whole blocks"),
    Submission("paged_free_list_as_a_stack", F03,
               (("""        while len(table) * self.block_size < length:
            if not self.free_blocks:
                raise RuntimeError(f"the KV cache is full: no free block for sequence {seq_id}; free finished "
                                   "sequences or make the pool larger")
            table.append(self.free_blocks.pop(0))
""", """        missing = -(-length // self.block_size) - len(table)  # ceil(length / block_size) blocks in all
        if missing > len(self.free_blocks):
            raise RuntimeError("out of KV cache blocks")
        for _ in range(missing):
            table.append(self.free_blocks.pop())  # the most recently freed first (a stack)
"""),),
               "the missing blocks counted at once, the free list used as a stack (last freed, first reused)"),
    # f04_flex_attention
    Submission("flex_window_with_and_masks", F04,
               (("from torch.nn.attention.flex_attention import create_block_mask, flex_attention",
                 "from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention"),
                ("""    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod
""", """    def recent(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return and_masks(causal, recent)  # FlexAttention's own combinator
""")),
               "the sliding window as and_masks(causal, a window mask_mod)"),
    Submission("flex_mask_as_a_score_mod", F04,
               (("""    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
""", """    if mask_mod is None:
        return flex_attention(q, k, v, score_mod=score_mod)

    def masked(score, b, h, q_idx, kv_idx):  # the mask folded into the scores: slower, the same numbers
        score = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
        return torch.where(mask_mod(b, h, q_idx, kv_idx), score, -float("inf"))

    return flex_attention(q, k, v, score_mod=masked)
"""),),
               "the mask_mod applied inside a score_mod (-inf where masked) instead of as a block mask"),
    Submission("flex_slopes_vectorised", F04,
               (("""    def geometric(n):  # 2^(-8/n), 2^(-16/n), ..., 2^(-8)
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][:num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)
""", """    n = 1 << (num_heads.bit_length() - 1)  # the largest power of 2 not above num_heads
    odd = 2 * torch.arange(num_heads - n) + 1  # the odd-numbered slopes of 2n heads
    exponents = torch.cat([torch.arange(1, n + 1) * 8.0 / n, odd * 8.0 / (2 * n)])
    return torch.pow(2.0, -exponents).float()
"""),),
               "the slopes as one vectorised power of 2 of their exponents"),
    # f05_sparse_indexer
    Submission("indexer_as_one_matmul", F05,
               (("    dots = torch.einsum(\"bthd,bsd->bths\", index_queries, index_keys) / index_dim**0.5"
                 "  # (b, n_q, heads, n_k)\n", ""),
                ("""    return torch.einsum("bth,bths->bts", head_weights, torch.relu(dots)) / index_heads**0.5
""", """    b, n_q = index_queries.shape[:2]
    flat = index_queries.reshape(b, n_q * index_heads, index_dim)  # every head of every query, one row each
    relu = torch.relu(flat @ index_keys.transpose(1, 2) / index_dim**0.5).view(b, n_q, index_heads, -1)
    return (head_weights.unsqueeze(-1) * relu).sum(dim=2) / index_heads**0.5
"""),),
               "the indexer's dot products as one batched matmul and a broadcast weighted sum"),
    Submission("sparse_attention_by_gathering", F05,
               (("""        chosen = self.select(x).unsqueeze(1)  # (b, 1, T, T): the same keys for every head
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(~chosen, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context_vec = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
""", """        # Gather each query's top_k keys and values (as a sparse kernel reads them), padded where it has fewer.
        scores = self.index_scores(x)
        k = min(self.top_k, num_tokens)
        best = scores.topk(k, dim=-1)
        index = best.indices[:, None, :, :, None].expand(b, self.num_heads, num_tokens, k, self.head_dim)

        def pick(t):  # (b, heads, T, head_dim) -> (b, heads, T, k, head_dim)
            return t[:, :, None].expand(b, self.num_heads, num_tokens, num_tokens, self.head_dim).gather(3, index)

        picked_keys, picked_values = pick(keys), pick(values)
        attn_scores = (queries[:, :, :, None] * picked_keys).sum(-1)  # (b, heads, T, k)
        attn_scores = attn_scores.masked_fill((best.values == -torch.inf)[:, None], -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context_vec = (attn_weights[..., None] * picked_values).sum(3).transpose(1, 2).reshape(b, num_tokens, -1)
"""),),
               "the selected keys and values gathered per query (top_k of them) instead of masking a dense matrix"),
    # f06_gated_delta_rule
    Submission("delta_rule_with_einsum", F06,
               (("""        predicted = (k[..., t, :, None] * state).sum(dim=-2)  # (b, h, d_v): what S holds for k_t
        update = beta[..., t, None] * (v[..., t, :] - predicted)  # (b, h, d_v)
        state = state + k[..., t, :, None] * update[..., None, :]  # + k_t u_t^T
        out[..., t, :] = (q[..., t, :, None] * state).sum(dim=-2)  # q_t^T S
""", """        k_t = k[..., t, :]
        update = beta[..., t, None] * (v[..., t, :] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, update)
        out[..., t, :] = torch.einsum("bhk,bhkv->bhv", q[..., t, :], state)
"""),),
               "the recurrence's reads and writes as einsums"),
    Submission("chunk_by_forward_substitution", F06,
               (("""    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (beta * torch.exp(gamma))[..., None] * k, upper=False,
                                      unitriangular=True)
""", """    # (I + A) X = R row by row: X_i = R_i - sum_{j < i} A_ij X_j (the inverse, as DeltaNet's papers write it)
    rhs = torch.cat([beta[..., None] * v, (beta * torch.exp(gamma))[..., None] * k], dim=-1)
    rows = []
    for i in range(size):
        done = torch.stack(rows, dim=-2) if rows else rhs[..., :0, :]
        rows.append(rhs[..., i, :] - (a[..., i, :i, None] * done).sum(dim=-2))
    solved = torch.stack(rows, dim=-2)
    u, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
"""),),
               "the unit lower-triangular systems solved by forward substitution, both right-hand sides at once"),
    # f07_cross_layer_kv
    Submission("kv_cache_as_a_dict", F07,
               (("        self.cache_k, self.cache_v = [], []\n\n    def reset_cache(self):\n"
                 "        self.cache_k, self.cache_v = [], []\n",
                 "        self.kv_cache = {}\n\n    def reset_cache(self):\n        self.kv_cache = {}\n\n"
                 "    @property\n    def cache_k(self):  # one entry per computing layer, in layer order\n"
                 "        return [self.kv_cache[layer][0] for layer in sorted(self.kv_cache)]\n\n"
                 "    @property\n    def cache_v(self):\n"
                 "        return [self.kv_cache[layer][1] for layer in sorted(self.kv_cache)]\n"),
                ("""                if use_cache:
                    slot = computing.index(layer)
                    if len(self.cache_k) > slot:
                        keys = torch.cat([self.cache_k[slot], keys], dim=2)
                        values = torch.cat([self.cache_v[slot], values], dim=2)
                        self.cache_k[slot], self.cache_v[slot] = keys, values
                    else:
                        self.cache_k.append(keys)
                        self.cache_v.append(values)
""", """                if use_cache:
                    if layer in self.kv_cache:
                        old_keys, old_values = self.kv_cache[layer]
                        keys, values = torch.cat([old_keys, keys], dim=2), torch.cat([old_values, values], dim=2)
                    self.kv_cache[layer] = keys, values
"""),
                ("        computing = [layer for layer, source in enumerate(self.kv_sources) if source == layer]\n",
                 "")),
               "the cache kept in a dict by layer, cache_k and cache_v read from it in layer order"),
    Submission("cla_groups_by_range", F07,
               (("return [layer - layer % share_every for layer in range(num_layers)]",
                 "return [first for first in range(0, num_layers, share_every)\n"
                 "            for _ in range(min(share_every, num_layers - first))]"),),
               "Cross-Layer Attention's sources written group by group"),
]

# ---------------------------------------------------------------- kernels (Triton; the interpreter without a GPU)
K01, K02, K03 = "k01_fused_softmax", "k02_tiled_scores", "k03_flash_forward"
K04, K05, K06 = "k04_flash_backward", "k05_flash_decoding", "k06_paged_decoding"

# k01's three passes load alike, and k02's three passes recompute a tile's scores alike: an edit of one line reaches
# every pass, as a learner's copy-paste does.
K02_CAUSAL = "allowed = allowed & (keys[None, :] <= rows[:, None])"

BUGS += [
    # k01_fused_softmax
    Submission("softmax_tail_loaded_as_zero", K01, sample_edits("softmax-tail-as-zero", K01),
               "the masked lanes of the last chunk loaded as 0: each adds exp(0 - max) to the sum",
               "loaded as 0", source="the masked load's `other` of Triton's tutorial softmax, written as 0"),
    Submission("softmax_max_not_subtracted", K01,
               (("lane_sum += tl.exp(x - row_max)", "lane_sum += tl.exp(x)"),
                ("y = tl.exp(x - row_max) / row_sum", "y = tl.exp(x) / row_sum")),
               "exp of the raw values: right until a value above about 88 overflows", "max was not subtracted"),
    Submission("softmax_max_of_the_last_chunk", K01,
               (("lane_max = tl.maximum(lane_max, x)", "lane_max = x"),),
               "the running max reset by every chunk: the last chunk's max is subtracted",
               "not carried across the chunks"),
    Submission("softmax_partial_chunk_skipped", K01,
               (("for start in range(0, n_cols, BLOCK_SIZE):", "for start in range(0, n_cols - BLOCK_SIZE + 1, "
                                                                "BLOCK_SIZE):"),),
               "the loops cover the full chunks only: the row's tail is never read nor written",
               "never read, nor written"),
    Submission("softmax_one_program", K01, (("grid = (rows.shape[0],)", "grid = (1,)"),),
               "a grid of one program: only the first row is computed", "programs than rows"),
    # k02_tiled_scores
    Submission("scores_diagonal_tile_skipped", K02,
               (("hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T",
                 "hi = tl.minimum(pid_m * BLOCK_M, T) if IS_CAUSAL else T"),),
               "the causal loop stops before the tile on the diagonal", "stops one tile early"),
    Submission("scores_diagonal_tile_not_masked", K02, ((K02_CAUSAL, "allowed = allowed & (keys[None, :] < T)"),),
               "causal tiles skipped but the tile on the diagonal not masked: queries see the later keys of their "
               "tile", "were not masked"),
    Submission("scores_scaled_by_block_d", K02,
               (("num_heads, T, d, 1.0 / math.sqrt(d),", "num_heads, T, d, 1.0 / math.sqrt(block_d),"),),
               "the scale from the padded head size, 1 / sqrt(BLOCK_D)", "1 / sqrt(BLOCK_D)"),
    Submission("scores_loop_end_in_key_tiles", K02,
               (("hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T",
                 "hi = tl.minimum((pid_m + 1) * BLOCK_N, T) if IS_CAUSAL else T"),),
               "the causal loop's end counted in key tiles, wrong when BLOCK_M != BLOCK_N", "measured in key tiles"),
    Submission("scores_key_tail_unmasked", K02, (("allowed = keys[None, :] < T", "allowed = keys[None, :] >= 0"),),
               "the keys past T in the last tile score 0 and take weight", "keys past T in the last tile"),
]

VARIANTS += [
    # k01_fused_softmax
    Submission("softmax_whole_row_in_one_block", K01,
               (("block = block_size or min(triton.next_power_of_2(n_cols), 1024)",
                 "block = min(triton.next_power_of_2(n_cols), 1024)  # one chunk per row, whatever block_size says"),),
               "block_size ignored: each row in one block (up to 1024 lanes)"),
    Submission("softmax_online_max_and_sum", K01,
               (('    lane_max = tl.full((BLOCK_SIZE,), float("-inf"), tl.float32)  '
                 '# (BLOCK_SIZE,) the largest value seen per lane\n'
                 """    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + lanes  # (BLOCK_SIZE,) the columns of this chunk
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, axis=0)  # scalar: the row's max
""", """    lane_max = tl.full((BLOCK_SIZE,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK_SIZE,), tl.float32)  # per lane, the sum of exp(x - lane_max): an online softmax
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + lanes
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that saw nothing yet
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
"""), ("""    lane_sum = tl.zeros((BLOCK_SIZE,), tl.float32)  # (BLOCK_SIZE,) the sum of exp(x - row_max) per lane
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + lanes
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(x - row_max)
    row_sum = tl.sum(lane_sum, axis=0)  # scalar: the softmax's denominator
""", "")),
               "the max and the sum in one pass, each lane an online softmax (two passes over the row, not three)"),
    Submission("softmax_exp2", K01,
               (("lane_sum += tl.exp(x - row_max)", "lane_sum += tl.exp2((x - row_max) * 1.4426950408889634)"),
                ("y = tl.exp(x - row_max) / row_sum", "y = tl.exp2((x - row_max) * 1.4426950408889634) / row_sum")),
               "exp2 with log2(e) folded in, as the fused kernels do"),
    # k02_tiled_scores
    Submission("scores_every_tile_masked", K02,
               (("hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T", "hi = T"),),
               "no tile skipped: the causal mask alone hides the future (right, twice the work)"),
    Submission("scores_keys_transposed_by_tl_trans", K02,
               (("""        kt = tl.load(k_base + keys[None, :] * sk_t + feats[:, None],
                     mask=(keys[None, :] < T) & (feats[:, None] < d), other=0.0)""",
                 """        kt = tl.trans(tl.load(k_base + keys[:, None] * sk_t + feats[None, :],
                              mask=(keys[:, None] < T) & (feats[None, :] < d), other=0.0))"""),),
               "each tile of keys loaded as (BLOCK_N, BLOCK_D) and transposed with tl.trans"),
    Submission("scores_own_tile_sizes", K02,
               (('    b, num_heads, T, d = q.shape\n    q, k = q.contiguous(), k.contiguous()',
                 '    b, num_heads, T, d = q.shape\n    block_m, block_n = 32, 64  # tiles of its own\n'
                 '    q, k = q.contiguous(), k.contiguous()'),),
               "tiles of 32 queries x 64 keys, whatever block_m and block_n say"),
]

BUGS += [
    # k03_flash_forward
    Submission("flash_accumulator_not_rescaled", K03, sample_edits("flash-acc-not-rescaled", K03),
               "the running accumulator not rescaled when a tile raises the max", "accumulator acc was not rescaled",
               source="issue 35's list; a classic of FlashAttention exercises"),
    Submission("flash_sum_not_rescaled", K03,
               (("l_i = l_i * alpha + tl.sum(p, axis=1)", "l_i = l_i + tl.sum(p, axis=1)"),),
               "the running sum not rescaled when a tile raises the max", "running sum l_i was not rescaled"),
    Submission("flash_max_updated_before_use", K03,
               (("        alpha = tl.exp(m_i - m_new)  # (BLOCK_M,) 0 on the first tile, where m_i = -inf\n",
                 "        m_i = m_new\n        alpha = tl.exp(m_i - m_new)\n"),),
               "m_i overwritten before the correction is computed from it: nothing is ever rescaled",
               "updated before it was used"),
    Submission("flash_p_from_the_old_max", K03,
               (("p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)", "p = tl.exp(s - m_i[:, None])"),),
               "the tile's exps taken relative to the max before the tile: exp(s + inf) on the first tile",
               "with the old max"),
    Submission("flash_lse_without_max", K03,
               (("tl.store(LSE + bh * T + rows, m_i + tl.log(l_i), mask=row_ok)",
                 "tl.store(LSE + bh * T + rows, tl.log(l_i), mask=row_ok)"),),
               "the log-sum-exp stored as log(l_i): l_i sums exp(s - m_i)", "stored without the max"),
    Submission("flash_causal_skip_off_by_one", K03,
               (("hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T",
                 "hi = tl.minimum(pid_m * BLOCK_M, T) if IS_CAUSAL else T"),),
               "the causal loop skips the tile on the diagonal too", "stops one tile early"),
    Submission("flash_key_tail_unmasked", K03,
               (("allowed = key_ok[None, :]  # (1, BLOCK_N)", "allowed = keys[None, :] >= 0"),),
               "the keys past T in the last tile score 0 and take weight", "keys past T in the last tile"),
    Submission("flash_output_not_normalised", K03, (("o = acc / l_i[:, None]  # (BLOCK_M, BLOCK_D)", "o = acc"),),
               "the accumulator stored as the output, never divided by the running sum",
               "not divided by the running sum"),
    Submission("flash_scaled_by_block_d", K03,
               (("num_heads, T, d, 1.0 / math.sqrt(d), IS_CAUSAL",
                 "num_heads, T, d, 1.0 / math.sqrt(block_d), IS_CAUSAL"),),
               "the scale from the padded head size, 1 / sqrt(BLOCK_D)", "1 / sqrt(BLOCK_D)"),
    Submission("flash_diagonal_tile_not_masked", K03,
               (("allowed = allowed & (keys[None, :] <= rows[:, None])  # (BLOCK_M, BLOCK_N)", "allowed = allowed"),),
               "causal tiles skipped but the tile on the diagonal not masked", "were not masked"),
]

VARIANTS += [
    # k03_flash_forward
    Submission("flash_exp2", K03,
               (("s = tl.dot(q, kt) * scale  # (BLOCK_M, BLOCK_N)", "s = tl.dot(q, kt) * (scale * 1.4426950408889634)"),
                ("alpha = tl.exp(m_i - m_new)", "alpha = tl.exp2(m_i - m_new)"),
                ("p = tl.exp(s - m_new[:, None])", "p = tl.exp2(s - m_new[:, None])"),
                ("m_i + tl.log(l_i), mask=row_ok)", "(m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)")),
               "base 2: log2(e) folded into the scale, exp2, and the lse converted back to base e"),
    Submission("flash_key_tiles_last_to_first", K03,
               (("""    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + cols  # (BLOCK_N,) the key positions of this tile""",
                 """    num_tiles = tl.cdiv(hi, BLOCK_N)
    for back in range(0, num_tiles):
        start_n = (num_tiles - 1 - back) * BLOCK_N  # the key tiles from the last to the first
        keys = start_n + cols"""),
                ("""        alpha = tl.exp(m_i - m_new)  # (BLOCK_M,) 0 on the first tile, where m_i = -inf
        p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)""",
                 """        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with every key masked so far
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])""")),
               "the key tiles walked last to first (the diagonal's first), rows with nothing seen yet guarded"),
    Submission("flash_no_tile_skipping", K03,
               (("hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T", "hi = T"),),
               "every key tile visited, the causal mask alone hiding the future"),
    Submission("flash_own_tile_sizes", K03,
               (("    b, num_heads, T, d = q.shape\n    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()\n"
                 "    o = torch.empty_like(q)",
                 "    b, num_heads, T, d = q.shape\n    block_m, block_n = 64, 32  # tiles of its own\n"
                 "    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()\n    o = torch.empty_like(q)"),),
               "tiles of 64 queries x 32 keys, whatever block_m and block_n say"),
]

K04_LAUNCHES = ("    dkdv_kernel[(triton.cdiv(T, block_n), b * num_heads)](q, k, v, do, lse, delta, dk, dv, *sizes, "
                "**meta)\n"
                "    dq_kernel[(triton.cdiv(T, block_m), b * num_heads)](q, k, v, do, lse, delta, dq, *sizes, "
                "**meta)\n")

BUGS += [
    # k04_flash_backward
    Submission("backward_dk_without_scale", K04,
               (("(dk * scale).to(DK.dtype.element_ty)", "dk.to(DK.dtype.element_ty)"),),
               "dK stored without the scale", "dK was not multiplied by the scale"),
    Submission("backward_without_scale", K04,
               (("(dk * scale).to(DK.dtype.element_ty)", "dk.to(DK.dtype.element_ty)"),
                ("(dq * scale).to(DQ.dtype.element_ty)", "dq.to(DQ.dtype.element_ty)")),
               "a backward without the scale: dQ and dK both miss 1 / sqrt(d)", "left out the scale"),
    Submission("backward_delta_left_out", K04,
               (("dsT = pT * (dpT - delta[None, :])", "dsT = pT * dpT"),
                ("ds = p * (dp - delta[:, None])", "ds = p * dp")),
               "softmax's backward as dS = P * dP, without D = rowsum(dO * O)", "left out D = rowsum(dO * O)"),
    Submission("backward_weights_without_lse", K04,
               (("tl.exp(sT - lse[None, :])", "tl.exp(sT)"), ("tl.exp(s - lse[:, None])", "tl.exp(s)")),
               "the weights recomputed as exp(s): the log-sum-exp never subtracted", "without the log-sum-exp"),
    Submission("backward_causal_mask_missing", K04,
               (("allowed = allowed & (keys[:, None] <= rows[None, :])  # key j seen by query i only when j <= i",
                 "allowed = allowed"),
                ("allowed = allowed & (keys[None, :] <= rows[:, None])", "allowed = allowed")),
               "the recomputed weights not masked causally inside the tiles the loops visit",
               "not masked causally inside the tiles"),
    Submission("backward_query_loop_starts_late", K04,
               (("lo = (start_n // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0",
                 "lo = (start_n // BLOCK_M + 1) * BLOCK_M if IS_CAUSAL else 0"),),
               "dK and dV's causal loop skips the query tile that holds its first keys", "starts one tile late"),
    Submission("autograd_gradients_swapped", K04, (("return dq, dk, dv, None", "return dk, dq, dv, None"),),
               "FlashAttention.backward returns dk where dq goes", "in the order of forward's inputs"),
]

VARIANTS += [
    # k04_flash_backward
    Submission("backward_dq_by_atomic_adds", K04,
               (("def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, s_b,",
                 "def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, s_b,"),
                ("        dk += tl.dot(dsT.to(q.dtype), q)  # (BLOCK_N, BLOCK_D)\n",
                 "        dk += tl.dot(dsT.to(q.dtype), q)  # (BLOCK_N, BLOCK_D)\n"
                 "        tl.atomic_add(DQ + base + rows[:, None] * s_t + feats[None, :],  # dQ from every key tile\n"
                 "                      tl.dot(tl.trans(dsT).to(k.dtype), k) * scale, mask=q_mask)\n"),
                (K04_LAUNCHES,
                 "    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)\n"
                 "    dkdv_kernel[(triton.cdiv(T, block_n), b * num_heads)](q, k, v, do, lse, delta, dk, dv, dq32,\n"
                 "                                                          *sizes, **meta)\n"
                 "    dq.copy_(dq32)\n")),
               "one kernel: each key tile adds its share of dQ with tl.atomic_add (the other loop order)"),
    Submission("backward_own_tile_sizes", K04,
               (("    lse = lse.float().contiguous()\n",
                 "    lse = lse.float().contiguous()\n    block_m, block_n = 32, 16  # tiles of its own\n"),),
               "tiles of 32 queries x 16 keys, whatever block_m and block_n say"),
]

K05_GUARDED = """    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(PO + (bh * NUM_SPLITS + split) * d + feats, tl.where(seen, acc / l_safe, 0.0), mask=feat_ok)
    tl.store(PLSE + bh * NUM_SPLITS + split, tl.where(seen, m_i + tl.log(l_safe), float("-inf")))
"""

BUGS += [
    # k05_flash_decoding
    Submission("decode_splits_averaged", K05, sample_edits("decode-splits-averaged", K05),
               "a combine without rescaling: the splits' outputs averaged", "the splits were averaged"),
    Submission("decode_combine_without_max", K05,
               (("w = tl.exp(lse - top)", "w = tl.exp(lse)"),
                ("tl.store(LSE + bh, top + tl.log(total))", "tl.store(LSE + bh, tl.log(total))")),
               "the splits weighed by exp(lse_s): right until a lse above about 88", "without subtracting the largest"),
    Submission("decode_partial_lse_without_max", K05,
               (('tl.where(seen, m_i + tl.log(l_safe), float("-inf"))',
                 'tl.where(seen, tl.log(l_safe), float("-inf"))'),),
               "each split's log-sum-exp stored as log(l_i)", "stored without its max"),
    Submission("decode_splits_too_short", K05,
               (("chunk = triton.cdiv(T, num_splits)", "chunk = T // num_splits"),),
               "splits of T // num_splits keys: the last keys belong to none", "T // num_splits"),
    Submission("decode_split_end_not_masked", K05, (("key_ok = keys < end", "key_ok = keys < T"),),
               "a split's last tile reads into the next split's keys", "not at the split's own end"),
    Submission("decode_partials_not_normalised", K05,
               (("tl.where(seen, acc / l_safe, 0.0), mask=feat_ok)", "tl.where(seen, acc, 0.0), mask=feat_ok)"),),
               "each split stores its accumulator, not divided by its sum", "without dividing it by its running sum"),
    Submission("decode_scores_not_scaled", K05,
               (("s = tl.where(key_ok, tl.sum(q[None, :] * k, axis=1) * scale, float(\"-inf\"))",
                 "s = tl.where(key_ok, tl.sum(q[None, :] * k, axis=1), float(\"-inf\"))"),),
               "the one query's scores not scaled", "with the scores not scaled"),
    Submission("decode_empty_split_nan", K05,
               ((K05_GUARDED, "    tl.store(PO + (bh * NUM_SPLITS + split) * d + feats, acc / l_i, mask=feat_ok)\n"
                              "    tl.store(PLSE + bh * NUM_SPLITS + split, m_i + tl.log(l_i))\n"),),
               "a split with no key stores 0 / 0", "stored 0 / 0 = NaN"),
]

VARIANTS += [
    # k05_flash_decoding
    Submission("decode_combine_in_torch", K05,
               (("""    combine_kernel[(b * num_heads,)](partial_o, partial_lse, o, lse, d, NUM_SPLITS=num_splits,
                                     BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(d))
""", """    top = partial_lse.amax(dim=-1, keepdim=True)  # the combine in torch: a few small tensors per head
    w = torch.exp(partial_lse - top)
    o = (w[..., None] * partial_o).sum(dim=-2) / w.sum(dim=-1, keepdim=True)
    lse = top[..., 0] + torch.log(w.sum(dim=-1))
"""),),
               "the splits combined in torch rather than a kernel of its own"),
    Submission("decode_own_tile", K05, (("BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d))",
                                         "BLOCK_N=32, BLOCK_D=triton.next_power_of_2(d))"),),
               "tiles of 32 keys, whatever block_n says"),
]

BUGS += [
    # k06_paged_decoding
    Submission("paged_logical_block_as_physical", K06,
               (("physical = tl.load(TABLES + r * st_b + j)", "physical = j"),),
               "the table never looked up: logical block j read as the pool's block j", "read as physical block j"),
    Submission("paged_slots_past_length_read", K06,
               (("token_ok = j * PAGE + slots < seq_len", "token_ok = slots < PAGE"),),
               "whole blocks read: the last block's slots past the sequence's length take part",
               "slots past the sequence's length"),
    Submission("paged_first_sequence_length", K06,
               (("seq_len = tl.load(LENS + r)", "seq_len = tl.load(LENS)"),),
               "every sequence given the first one's length", "the first sequence's length"),
    Submission("paged_first_table_row", K06,
               (("physical = tl.load(TABLES + r * st_b + j)", "physical = tl.load(TABLES + j)"),),
               "every sequence reads the first sequence's blocks", "read the block table's first row"),
    Submission("paged_empty_split_nan", K06,
               ((K05_GUARDED, "    tl.store(PO + (bh * NUM_SPLITS + split) * d + feats, acc / l_i, mask=feat_ok)\n"
                              "    tl.store(PLSE + bh * NUM_SPLITS + split, m_i + tl.log(l_i))\n"),),
               "a short sequence's empty split stores 0 / 0", "stored 0 / 0 = NaN"),
]

VARIANTS += [
    # k06_paged_decoding
    Submission("paged_combined_in_torch", K06,
               (("    o, _ = combine_splits(partial_o, partial_lse)\n",
                 "    top = partial_lse.amax(dim=-1, keepdim=True)  # stage k05's combine, in torch\n"
                 "    w = torch.exp(partial_lse - top)\n"
                 "    o = (w[..., None] * partial_o).sum(dim=-2) / w.sum(dim=-1, keepdim=True)\n"),),
               "the splits combined in torch, not through stage k05's combine_splits"),
    Submission("paged_table_row_as_pointer", K06,
               (("    for j in range(first, last):\n        physical = tl.load(TABLES + r * st_b + j)",
                 "    table = TABLES + r * st_b  # this sequence's row of the block table\n"
                 "    for j in range(first, last):\n        physical = tl.load(table + j)"),),
               "the sequence's row of the table taken once, as a pointer"),
]
