"""Stage f03: a paged KV cache, the idea behind vLLM's PagedAttention.

Stage m03's cache gives each sequence one contiguous tensor that grows by torch.cat. A server decoding
hundreds of sequences at once cannot work that way: it does not know how long each answer will be, so it
would reserve the whole context for every sequence and waste most of it, and every cat copies the cache.
vLLM (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", 2023)
borrows virtual memory's answer. The GPU memory for keys and values is one pool of fixed-size BLOCKS of
block_size token slots each, allocated once. A sequence owns a list of blocks, its BLOCK TABLE: the token at
position p lives in block table[p // block_size], slot p % block_size. A sequence takes a block from the free
list only when its last block is full, so at most block_size - 1 slots per sequence are wasted; when it ends,
its blocks go back to the free list and the next sequences reuse them. Blocks need not be neighbours: the
table says where each piece is.

To attend, a sequence's keys and values are gathered through its table (the fused kernels read them in place,
block by block); the attention itself is chapter 3's, with the causal rows of stage m03. Done right, every step
gives exactly what a contiguous cache gives, and the memory in use is the blocks held, not the longest context.

API
    PagedAttention(d_in, d_out, num_heads, num_blocks, block_size, qkv_bias=False)
        W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=qkv_bias), out_proj = nn.Linear(d_out, d_out); the
        pool: buffers k_pool and v_pool (num_blocks, num_heads, block_size, head_dim), allocated once.
        forward(x, seq_ids): x (b, num_new, d_in), row r holding the next num_new tokens of sequence seq_ids[r] (an
            int; a new id starts a new sequence) -> (b, num_new, d_out): each row's causal attention over every
            token of its sequence so far, its keys and values written into its blocks.
        free(seq_id): the sequence is done; its blocks go back to the free list.
        block_table(seq_id) -> list of the sequence's block ids, in order; blocks_in_use() -> int
        Running out of blocks raises RuntimeError.

What the checks test besides: every output equals what a contiguous cache gives (the full causal forward of each
sequence); after each step a sequence of n tokens holds exactly ceil(n / block_size) blocks and blocks_in_use()
counts the live sequences' blocks; freed blocks are taken again (a pool that holds just what the busiest moment needs
must suffice); no two live sequences share a block; k_pool and v_pool keep their shape; the module runs in the dtype
and on the device of its parameters (the large case in bfloat16, on a GPU when there is one, at bfloat16's
tolerance).
"""
import torch
import torch.nn as nn


class PagedAttention(nn.Module):
    """Causal multi-head attention over a KV cache paged into fixed-size blocks (see the module docstring)."""

    def __init__(self, d_in, d_out, num_heads, num_blocks, block_size, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.block_size = block_size
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        # The pool: every block the cache will ever use, allocated once (model.to(device) moves it). It is the
        # state of the sequences being served, not part of the model: persistent=False keeps it out of the weights.
        pool = (num_blocks, num_heads, block_size, self.head_dim)
        self.register_buffer("k_pool", torch.zeros(pool), persistent=False)
        self.register_buffer("v_pool", torch.zeros(pool), persistent=False)
        self.free_blocks = list(range(num_blocks))  # the free list
        self.block_tables = {}  # seq_id -> [block ids], in the order of the sequence's tokens
        self.seq_lens = {}  # seq_id -> number of tokens cached

    def block_table(self, seq_id):
        return list(self.block_tables.get(seq_id, []))

    def blocks_in_use(self):
        return sum(len(table) for table in self.block_tables.values())

    def allocate(self, seq_id, num_new):
        """Make room for num_new more tokens of sequence seq_id (a new one starts empty): take blocks from the free
        list until its table has slots for all its tokens. RuntimeError when the free list runs dry."""
        # TODO: A sequence of n tokens needs ceil(n / block_size) blocks; take only what is missing (its last block
        #       may still have free slots): self.free_blocks.pop(0) (any free block would do; the table keeps order).
        raise NotImplementedError("f03_paged_kv_cache: PagedAttention.allocate: see its TODO")

    def write(self, seq_id, keys, values):
        """Store the new tokens' keys and values (num_heads, num_new, head_dim) of sequence seq_id in its blocks,
        after its cached tokens (allocate made room), and count them in self.seq_lens."""
        # TODO: The token at position p goes to block table[p // block_size], slot p % block_size. Index the pool with
        #       a tensor of blocks and one of slots (one of each per new token): k_pool[blocks, :, slots] is
        #       (num_new, num_heads, head_dim).
        raise NotImplementedError("f03_paged_kv_cache: PagedAttention.write: see its TODO")

    def gather(self, seq_id):
        """Every cached key and value of sequence seq_id, in order: two (num_heads, seq_len, head_dim) tensors."""
        # TODO: Take the sequence's blocks from the pool in table order, (num_blocks_held, num_heads, block_size,
        #       head_dim), lay them end to end along the token axis, and cut at the sequence's length: the slots after
        #       it are unwritten (or still hold a freed sequence's keys).
        raise NotImplementedError("f03_paged_kv_cache: PagedAttention.gather: see its TODO")

    def free(self, seq_id):
        """The sequence is done: its blocks go back to the free list, its table and length are forgotten."""
        # TODO: Return the blocks (their contents may stay: no one reads a slot past a sequence's length).
        raise NotImplementedError("f03_paged_kv_cache: PagedAttention.free: see its TODO")

    def split_heads(self, t):
        """(num_new, d_out) -> (num_heads, num_new, head_dim) for one sequence."""
        return t.view(t.shape[0], self.num_heads, self.head_dim).transpose(0, 1)

    def forward(self, x, seq_ids):
        b, num_new, _ = x.shape
        assert len(seq_ids) == b and len(set(seq_ids)) == b, "one distinct sequence per row of x"
        outputs = []
        for row, seq_id in enumerate(seq_ids):
            # One sequence: its new tokens' queries, keys and values, (num_heads, num_new, head_dim) each.
            queries, keys, values = (self.split_heads(W(x[row])) for W in (self.W_query, self.W_key, self.W_value))
            self.allocate(seq_id, num_new)
            self.write(seq_id, keys, values)
            keys, values = self.gather(seq_id)  # (num_heads, num_keys, head_dim): the whole sequence so far
            num_keys = keys.shape[1]
            # Stage m03's attention: the new queries are positions num_keys - num_new .. num_keys - 1.
            future = torch.ones(num_new, num_keys, dtype=torch.bool, device=x.device).triu(num_keys - num_new + 1)
            attn_scores = (queries @ keys.transpose(1, 2)).masked_fill(future, -torch.inf)
            attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
            context_vec = (attn_weights @ values).transpose(0, 1).reshape(num_new, self.d_out)
            outputs.append(self.out_proj(context_vec))
        return torch.stack(outputs)  # (b, num_new, d_out)
