"""A tiny causal transformer policy, small enough to learn the reference task on one CPU core."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .losses import token_entropy

__all__ = [
    "KVCache", "TinyPolicy", "build_base_policy", "response_logprobs", "scored_tokens", "sample_responses",
]


class _Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, d_ff)
        self.mlp_out = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d_model, dim=-1)
        # (batch, heads, seq, head_dim) for scaled_dot_product_attention
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))

    def forward_cached(self, x: Tensor, keys: Tensor, values: Tensor, starts: Tensor) -> Tensor:
        """`forward` for `x` (batch, seq, d_model) at positions `starts[row]` on of each row, writing its
        keys/values into the cache `keys`/`values` (batch, heads, width, head_dim) at those positions
        and attending to the row's cached ones before them (a row sees nothing past its own length)."""
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        positions = starts.unsqueeze(1) + torch.arange(seq)  # (batch, seq)
        rows = torch.arange(batch).unsqueeze(1)
        keys[rows, :, positions] = k.transpose(1, 2)
        values[rows, :, positions] = v.transpose(1, 2)
        width = int(positions.max()) + 1
        # (batch, 1, seq, width): a query attends to the keys at or before its own position
        visible = (torch.arange(width).view(1, 1, width) <= positions.unsqueeze(-1)).unsqueeze(1)
        attended = F.scaled_dot_product_attention(q, keys[:, :, :width], values[:, :, :width], attn_mask=visible)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class KVCache:
    """Each block's cached keys and values, `(rows, heads, max_seq_len, head_dim)`: row `r` holds its
    first `lengths[r]` positions (the rest is stale and never attended to)."""

    def __init__(self, policy: TinyPolicy, rows: int) -> None:
        first = policy.blocks[0]
        shape = (rows, first.n_heads, policy.max_seq_len, first.qkv.in_features // first.n_heads)
        dtype = policy.head.weight.dtype  # the weights' (an explorer may hold bf16: transport.wire_dtype)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in policy.blocks]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in policy.blocks]
        self.lengths = torch.zeros(rows, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.lengths)

    def keep(self, rows: Tensor) -> None:
        """Keep only `rows` (indices), in that order."""
        kept = self.select(rows)
        self.keys, self.values, self.lengths = kept.keys, kept.values, kept.lengths

    def select(self, rows: Tensor) -> KVCache:
        """A copy holding only `rows` (indices), in that order."""
        copy = KVCache.__new__(KVCache)
        copy.keys, copy.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        copy.lengths = self.lengths[rows]
        return copy

    def extend(self, other: KVCache) -> None:
        """Append `other`'s rows after this cache's, in `other`'s dtype (the weights' now: an engine
        may be cast to the wire dtype after its pool's empty cache was made)."""
        self.keys = [torch.cat([a.to(b.dtype), b]) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([a.to(b.dtype), b]) for a, b in zip(self.values, other.values)]
        self.lengths = torch.cat([self.lengths, other.lengths])

    def assign(self, rows: Tensor, other: KVCache) -> None:
        """Overwrite `rows` (indices) with `other`'s rows, in order."""
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[rows] = theirs
        self.lengths[rows] = other.lengths


class TinyPolicy(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, final norm, untied output head.

    The head is untied so every parameter owns its storage: weight tensors then serialize
    (safetensors refuses shared storage) and receive in place one by one.
    """

    def __init__(
        self, *, vocab_size: int, max_seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits `(batch, seq, vocab)` for next-token prediction at every position."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def forward_cached(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Logits `(batch, seq, vocab)` of `tokens`, each row continuing its cached positions (the
        row's `cache.lengths` on), which it extends by `seq`: `forward`'s result for the row's whole
        sequence, at the new positions, computing only those."""
        starts = cache.lengths
        positions = starts.unsqueeze(1) + torch.arange(tokens.shape[1])
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block, keys, values in zip(self.blocks, cache.keys, cache.values):
            x = block.forward_cached(x, keys, values, starts)
        cache.lengths = starts + tokens.shape[1]
        return self.head(self.final_norm(x))


def build_base_policy(
    *, seed: int, vocab_size: int, max_seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int
) -> TinyPolicy:
    """The version-0 policy: identical in every process for the same seed, so nothing is transferred.

    `fork_rng` keeps the caller's global RNG untouched by the initialisation.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = TinyPolicy(
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            d_ff=d_ff,
        )
        # Small normal init (GPT-2 style) keeps the initial policy close to uniform.
        for name, parameter in policy.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif "norm" in name:
                nn.init.ones_(parameter)
            else:
                nn.init.normal_(parameter, std=0.02)
    return policy


def _masked_log_softmax(logits: Tensor, allowed_tokens: Tensor, temperature: float) -> Tensor:
    disallowed = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    disallowed[allowed_tokens] = False
    return F.log_softmax((logits / temperature).masked_fill(disallowed, float("-inf")), dim=-1)


def response_logprobs(
    policy: TinyPolicy,
    prompts: Tensor,
    responses: Tensor,
    *,
    allowed_tokens: Tensor,
    temperature: float,
) -> Tensor:
    """Log-probability of each response token under `policy`, shape `(batch, response_len)`.

    Uses the same token mask and temperature as `sample_responses`, so on-policy ratios are exactly 1.
    Prompts share one length; responses are right-padded (padding is ignored by causal attention
    for the positions before it, and the caller masks the padded positions).
    """
    tokens = torch.cat([prompts, responses], dim=1)
    starts = torch.full((len(tokens),), prompts.shape[1])
    logprobs, _ = scored_tokens(policy, tokens, starts, width=responses.shape[1], allowed_tokens=allowed_tokens,
                                temperature=temperature)
    return logprobs


def scored_tokens(
    policy: TinyPolicy,
    tokens: Tensor,
    starts: Tensor,
    *,
    width: int,
    allowed_tokens: Tensor,
    temperature: float,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs `(batch, width)` of the `width` tokens of each row from `starts[row]` on (each row
    a prompt then its response, right-padded to `tokens`' width, at least `starts + width`), under
    the sampler's token mask and temperature; with `entropy`, the entropy of each of those
    distributions too (no gradient). A token outside `allowed_tokens` has logprob -inf.
    """
    logits = policy(tokens[:, :-1])
    offsets = starts.unsqueeze(1) - 1 + torch.arange(width).unsqueeze(0)  # (batch, width): the predicting position
    picked = logits.gather(1, offsets.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logprobs = _masked_log_softmax(picked, allowed_tokens, temperature)
    targets = tokens.gather(1, offsets + 1)
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return chosen, token_entropy(logprobs) if entropy else None


@torch.no_grad()
def sample_responses(
    policy: TinyPolicy,
    prompts: Tensor,
    *,
    max_new_tokens: int,
    allowed_tokens: Tensor,
    eos_token: int,
    temperature: float,
    generator: torch.Generator,
    before_token: Callable[[], None] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one response per prompt row (greedy at temperature 0), stopping each at EOS; returns
    tokens and their logprobs.

    Recomputes the whole (short) sequence each step: no KV cache, fewer moving parts (the engine
    generates with `tiny_generation.GenerationPool`; this is the reference it is measured by) — and a pause
    for new weights (`before_token`, called before each token is sampled; it may load weights into
    `policy`) continues from the tokens so far with nothing computed by the old weights kept.
    """
    batch = prompts.shape[0]
    tokens = prompts
    finished = torch.zeros(batch, dtype=torch.bool)
    sampled, sampled_logprobs = [], []
    for _ in range(max_new_tokens):
        if before_token is not None:
            before_token()
        # temperature 0 is greedy: the most likely allowed token (its logprob at temperature 1)
        logprobs = _masked_log_softmax(policy(tokens)[:, -1], allowed_tokens, temperature or 1.0)
        if temperature == 0:
            next_tokens = logprobs.argmax(dim=-1)
        else:
            next_tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        next_tokens = next_tokens.masked_fill(finished, eos_token)
        sampled.append(next_tokens)
        sampled_logprobs.append(logprobs.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1))
        tokens = torch.cat([tokens, next_tokens.unsqueeze(-1)], dim=1)
        finished |= next_tokens == eos_token
        if finished.all():
            break
    all_tokens = torch.stack(sampled, dim=1).tolist()
    all_logprobs = torch.stack(sampled_logprobs, dim=1).tolist()
    responses, logprobs_out = [], []
    for row_tokens, row_logprobs in zip(all_tokens, all_logprobs):
        # Keep up to and including the first EOS: EOS is a sampled action with its own logprob.
        length = row_tokens.index(eos_token) + 1 if eos_token in row_tokens else len(row_tokens)
        responses.append(row_tokens[:length])
        logprobs_out.append(row_logprobs[:length])
    return responses, logprobs_out
