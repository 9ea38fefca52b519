"""A Llama decoder layer (RMSNorm, RoPE, grouped-query causal attention through
F.scaled_dot_product_attention, SwiGLU MLP): transformers' LlamaDecoderLayer where it is
installed, else this file's equivalent module. Used by bench_models.py and the backend's tests."""
import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(torch.nn.Module):
    """hidden -> x + attn(norm(x)) -> + mlp(norm(.)), the Llama-3 layout."""

    def __init__(self, hidden, heads, kv_heads, inner, theta=500000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, inner, bias=False)
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.theta = theta

    def rope(self, seq, device, dtype):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq, device=device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, group, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, group, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def decode_step(module, x, k_cache, v_cache):
    """One new token through an equivalent DecoderLayer (or a transformers LlamaDecoderLayer, whose
    weights it reads by name): x [b, 1, hidden] attends to the cache [b, kv_heads, L, head_dim] and
    to itself at position L. Grouped-query attention without copying K/V per head: the query heads
    of one KV head are the rows of that head's attention. Returns the layer's output."""
    parts = _decode_parts(module)
    b, length = x.shape[0], k_cache.shape[2]
    heads, kv_heads, head_dim = parts["heads"], parts["kv_heads"], parts["head_dim"]
    h = parts["norm1"](x)
    q = parts["q"](h).view(b, 1, heads, head_dim).transpose(1, 2)
    k = parts["k"](h).view(b, 1, kv_heads, head_dim).transpose(1, 2)
    v = parts["v"](h).view(b, 1, kv_heads, head_dim).transpose(1, 2)
    cos, sin = _rope_at(length, head_dim, parts["theta"], x.device, x.dtype)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    keys, values = torch.cat((k_cache, k), dim=2), torch.cat((v_cache, v), dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads, head_dim), keys, values)
    x = x + parts["o"](o.reshape(b, 1, heads * head_dim))
    h = parts["norm2"](x)
    return x + parts["down"](torch.nn.functional.silu(parts["gate"](h)) * parts["up"](h))


def _rope_at(position, head_dim, theta, device, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = position * inv
    angles = torch.cat((angles, angles))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope_theta(config) -> float:
    """The rotary base of a LlamaConfig: an attribute in older transformers, in rope_parameters in newer."""
    theta = getattr(config, "rope_theta", None)
    return theta if theta is not None else config.rope_parameters["rope_theta"]


def _decode_parts(module) -> dict:
    """The submodules and sizes decode_step reads, from either layer class."""
    if isinstance(module, DecoderLayer):
        return dict(heads=module.heads, kv_heads=module.kv_heads, head_dim=module.head_dim, theta=module.theta,
                    norm1=module.norm1, norm2=module.norm2, q=module.q, k=module.k, v=module.v, o=module.o,
                    gate=module.gate, up=module.up, down=module.down)
    attn, mlp, config = module.self_attn, module.mlp, module.self_attn.config
    return dict(heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
                theta=_rope_theta(config), norm1=module.input_layernorm, norm2=module.post_attention_layernorm,
                q=attn.q_proj, k=attn.k_proj, v=attn.v_proj, o=attn.o_proj, gate=mlp.gate_proj, up=mlp.up_proj,
                down=mlp.down_proj)


def make_layer(hidden, heads, kv_heads, inner, dtype, device, use_transformers=True):
    """(module, forward(module, x)) of a decoder layer: transformers' where it can be had."""
    if use_transformers:
        try:
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        except ImportError:
            use_transformers = False
    if use_transformers:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inner, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, rope_theta=500000.0, max_position_embeddings=131072)
        config._attn_implementation = "sdpa"
        layer = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype)
        rotary = LlamaRotaryEmbedding(config).to(device)

        def forward(module, x):
            positions = torch.arange(x.shape[1], device=x.device)[None]
            out = module(x, position_embeddings=rotary(x, positions), position_ids=positions, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out
        return layer, forward, "transformers LlamaDecoderLayer"
    layer = DecoderLayer(hidden, heads, kv_heads, inner).to(device=device, dtype=dtype)

    def forward(module, x):
        cos, sin = module.rope(x.shape[1], x.device, x.dtype)
        return module(x, cos, sin)
    return layer, forward, "equivalent DecoderLayer"
