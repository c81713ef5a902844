"""Stage f06: linear attention with a gated delta rule (Gated DeltaNet, as Qwen3-Next runs it in 3 of every 4 layers).

Softmax attention keeps every key and value (the KV cache) and reads all of them for every new token. Linear
attention keeps one matrix per head instead, the STATE S (d_k x d_v), and a token updates it and reads from it:
memory and time per token no longer grow with the text. The state is an associative memory: key k_t stores
value v_t, and q_t reads S^T q_t.

The DELTA RULE (Schlag et al. 2021, DeltaNet) writes like a learner correcting an error: it first reads what the
state already predicts for k_t, S^T k_t, and stores only the difference, with a learning rate beta_t in (0, 1):
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
A GATE alpha_t = exp(g_t) in (0, 1] (Gated DeltaNet, Yang, Kautz and Hatamizadeh, ICLR 2025) lets the state forget,
decaying it before each update. Per token t (the queries scaled by 1/sqrt(d_k), the keys of unit length):
    S <- exp(g_t) S                            (forget)
    u_t = beta_t (v_t - S^T k_t)               (what the state gets wrong about v_t, times the learning rate)
    S <- S + k_t u_t^T                         (write)
    o_t = S^T q_t                              (read, after the write)

That is the RECURRENT form: one small step per token, ideal for decoding, slow for a long prompt. The CHUNKED form
gives the same outputs with matrix products: within a chunk of C tokens starting from state S0, with gamma_i the
sum of g over the chunk's tokens up to i and Gamma[i, j] = exp(gamma_i - gamma_j) for j <= i (0 above),
    A = strictly lower part of (diag(beta) K K^T) * Gamma          (how each update changes the later ones)
    U = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta exp(gamma)) K      (a unit lower-triangular solve)
    V_new = U - W S0                                               (the u_t of the chunk's tokens)
    O = (Q * exp(gamma)) S0 + ((Q K^T) * Gamma) V_new              (the diagonal included)
    S_end = exp(gamma_C) S0 + (K * exp(gamma_C - gamma))^T V_new
(the "WY"/UT representation of DeltaNet's chunkwise algorithm, as in the flash-linear-attention kernels and the
torch fallback of Hugging Face's Qwen3-Next). Both forms carry only S between tokens or chunks: its size is
d_k x d_v per head, whatever the length of the text.

API (q, k: (b, h, T, d_k); v: (b, h, T, d_v); g, beta: (b, h, T); state: (b, h, d_k, d_v); sums in float32, or
float64 for float64 inputs; outputs in v's dtype)
    gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None) -> (out (b, h, T, d_v), final state)
    gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None) -> the same
    GatedDeltaNet(d_in, d_out, num_heads)
        head_dim = d_out // num_heads (= d_k = d_v). W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=False);
        W_beta, W_gate = nn.Linear(d_in, num_heads) (beta = sigmoid(W_beta x), g = logsigmoid(W_gate x));
        out_proj = nn.Linear(d_out, d_out). Queries and keys L2-normalised per head.
        forward(x, use_cache=False, chunk_size=None): (b, T, d_in) -> (b, T, d_out), recurrent form when chunk_size is
        None, chunked otherwise. With use_cache, starts from and leaves its state in `state` (b, h, d_k, d_v), None
        when empty; reset_cache() empties it.

What the checks test besides: each form on its own (the recurrent and the chunked form are graded separately, each
against the recurrence), outputs and final state, with and without an initial state, for chunk sizes that do and do
not divide the length; the large case runs the chunked form in bfloat16 (on a GPU when there is one) against a
float32 recurrence at bfloat16's tolerance.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """The gated delta rule, token by token (see the module docstring): (out (b, h, T, d_v), final state)."""
    b, h, num_tokens, d_k = k.shape
    dtype = v.dtype
    work = torch.promote_types(dtype, torch.float32)  # a sum over thousands of tokens: not in bfloat16
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    q = q / d_k**0.5
    state = (torch.zeros(b, h, d_k, v.shape[-1], dtype=work, device=v.device) if initial_state is None
             else initial_state.to(work))
    out = torch.empty_like(v)  # (b, h, T, d_v)
    # TODO: For each token t: forget (the state times exp(g[..., t])), the state's prediction for k_t (k_t^T S, a d_v
    #       vector per head), u_t = beta_t (v_t - prediction), write (S + k_t u_t^T: an outer product), read
    #       out[..., t, :] = q_t^T S. Shapes per head: k_t (d_k,), v_t (d_v,), S (d_k, d_v).
    raise NotImplementedError("f06_gated_delta_rule: gated_delta_rule_recurrent: see its TODO")
    return out.to(dtype), state


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None):
    """The same outputs and final state as gated_delta_rule_recurrent, a chunk of chunk_size tokens at a time (the
    last chunk may be shorter), with the formulas of the module docstring."""
    b, h, num_tokens, d_k = k.shape
    dtype = v.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    q = q / d_k**0.5
    state = (torch.zeros(b, h, d_k, v.shape[-1], dtype=work, device=v.device) if initial_state is None
             else initial_state.to(work))
    out = torch.empty_like(v)
    for start in range(0, num_tokens, chunk_size):
        chunk = slice(start, min(start + chunk_size, num_tokens))
        out[..., chunk, :], state = chunk_step(q[..., chunk, :], k[..., chunk, :], v[..., chunk, :], g[..., chunk],
                                               beta[..., chunk], state)
    return out.to(dtype), state


def chunk_step(q, k, v, g, beta, state):
    """One chunk of C tokens from the state S0 it starts with: (its outputs (b, h, C, d_v), the state after it).
    q (already scaled), k: (b, h, C, d_k); v: (b, h, C, d_v); g, beta: (b, h, C); state: (b, h, d_k, d_v)."""
    # TODO: gamma = the cumulative sum of g over the chunk (the log decay from its start to each token); Gamma (C x C)
    #       = exp(gamma_i - gamma_j) on and below the diagonal (j <= i), 0 above (mask before exp: above it the exponent
    #       is positive and may overflow); A = the strictly lower part of beta_i (k_i . k_j) Gamma[i, j]; U and W from
    #       (I + A) X = rhs by torch.linalg.solve_triangular(I + A, rhs, upper=False, unitriangular=True) (which takes
    #       the diagonal as 1); V_new = U - W S0; then the chunk's outputs and the state after it.
    raise NotImplementedError("f06_gated_delta_rule: chunk_step: see its TODO")


class GatedDeltaNet(nn.Module):
    """A gated-delta-rule attention layer with a recurrent state as its cache (see the module docstring)."""

    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.W_beta = nn.Linear(d_in, num_heads)  # each head's learning rate, per token
        self.W_gate = nn.Linear(d_in, num_heads)  # each head's forgetting, per token
        self.out_proj = nn.Linear(d_out, d_out)
        self.state = None

    def reset_cache(self):
        self.state = None

    def forward(self, x, use_cache=False, chunk_size=None):
        b, num_tokens, _ = x.shape

        def heads(t):  # (b, T, d_out) -> (b, num_heads, T, head_dim)
            return t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        # TODO: Queries and keys of unit length per head (F.normalize over head_dim): the delta rule's keys must not
        #       grow the state; beta = sigmoid(W_beta(x)) in (0, 1), g = logsigmoid(W_gate(x)) <= 0, each (b, num_heads,
        #       T). Run the chunked form when chunk_size is given, the recurrent one otherwise, from self.state when
        #       use_cache (which then keeps the final state); merge the heads, out_proj.
        raise NotImplementedError("f06_gated_delta_rule: GatedDeltaNet.forward: see its TODO")
