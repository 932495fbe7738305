"""Bring your own decoder, shown with the demo model of seed 001.

`SimpleForCausalLM` below is the seed's code as a user would have it: RMSNorm,
a fused qkv projection, causal attention without any positional encoding,
SwiGLU, a tied lm_head, and no KV cache. The toolkit never defined it.
`SeedDemoAdapter` is all a user writes to export and verify it: a forward with
the toolkit's signature that calls the user's own submodules and lets
`reference.layers.attend` keep the cache and the masks.

Run it:  python examples/byo_seed001.py [OUTPUT_FOLDER]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from exporter.errors import ToolkitError
from reference import CausalLMOutput, DecoderAdapter, DecoderSpec, check_adapter, seeded_init_
from reference.errors import ModelError
from reference.layers import attend, shifted_cross_entropy


# ----------------------------------------------------------------- the user's model (seed 001, unchanged)
class SimpleRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class SimpleAttention(nn.Module):
    def __init__(self, hidden_size, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = hidden_size // n_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        bsz, seq, _ = x.shape
        qkv = self.qkv(x).view(bsz, seq, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        q, k, v = [t.transpose(1, 2) for t in (q, k, v)]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        scores += mask
        attn = F.softmax(scores, dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(bsz, seq, -1)
        return self.o_proj(out)


class SwiGLUFFN(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SimpleBlock(nn.Module):
    def __init__(self, hidden_size, n_heads, intermediate_size):
        super().__init__()
        self.input_layernorm = SimpleRMSNorm(hidden_size)
        self.self_attn = SimpleAttention(hidden_size, n_heads)
        self.post_attention_layernorm = SimpleRMSNorm(hidden_size)
        self.mlp = SwiGLUFFN(hidden_size, intermediate_size)

    def forward(self, x):
        residual = x
        x = self.input_layernorm(x)
        x = self.self_attn(x)
        x = residual + x
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class SimpleModel(nn.Module):
    def __init__(self, vocab_size, hidden_size, n_layers, n_heads, intermediate_size):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList([SimpleBlock(hidden_size, n_heads, intermediate_size) for _ in range(n_layers)])
        self.norm = SimpleRMSNorm(hidden_size)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class SimpleForCausalLM(nn.Module):
    def __init__(self, vocab_size, hidden_size, n_layers, n_heads, intermediate_size, tie_weights=True):
        super().__init__()
        self.model = SimpleModel(vocab_size, hidden_size, n_layers, n_heads, intermediate_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None, logits_to_keep=0):
        hidden = self.model(input_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:, :]) if logits_to_keep > 0 else self.lm_head(hidden)
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(
                shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100
            )
        return logits, loss


# ----------------------------------------------------------------- what the user writes for the toolkit
class SeedDemoAdapter(DecoderAdapter):
    """The toolkit's forward for SimpleForCausalLM, built from its own submodules."""

    def __init__(self, model: SimpleForCausalLM, max_position_embeddings: int = 2048):
        attn = model.model.layers[0].self_attn
        spec = DecoderSpec(
            name="seed001-demo",
            num_hidden_layers=len(model.model.layers),
            num_key_value_heads=attn.n_heads,
            head_dim=attn.head_dim,
            num_attention_heads=attn.n_heads,
            hidden_size=model.model.embed_tokens.embedding_dim,
            vocab_size=model.model.embed_tokens.num_embeddings,
            max_position_embeddings=max_position_embeddings,
        )  # no positions: any cap works
        super().__init__(model, spec)

    def forward(
        self,
        input_ids,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        logits_to_keep=0,
        labels=None,
        position_ids=None,
    ):
        # position_ids are accepted and unused: the demo model has no positional encoding.
        h = self.model.model.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            b, t, _ = h.shape
            q, k, v = attn.qkv(layer.input_layernorm(h)).view(b, t, 3, attn.n_heads, attn.head_dim).unbind(dim=2)
            past = past_key_values[i] if past_key_values is not None else None
            out, present = attend(q, k, v, past, attention_mask)  # the cache and the masks
            presents.append(present)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(self.model.model.norm(h)[:, -logits_to_keep:, :])
        loss = shifted_cross_entropy(logits, labels) if labels is not None else None
        return CausalLMOutput(logits, presents if use_cache else None, loss, logits.new_zeros(()))


def demo_model(seed: int = 0) -> SimpleForCausalLM:
    """The seed's small configuration, scaled up a little so tokens vary (seeded weights)."""
    return seeded_init_(
        SimpleForCausalLM(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, intermediate_size=128), seed
    ).eval()


def main(folder: str) -> int:
    from exporter import verify_artifact
    from exporter.export.pipeline import export_artifact
    from exporter.verify.reports import format_verify

    user_model = demo_model()
    adapter = SeedDemoAdapter(user_model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    check = check_adapter(adapter, lambda x: user_model(x)[0], ids)
    print(f"adapter vs original: {check.full_forward_max_abs:.2g}; cached vs full: {check.cached_decode_max_abs:.2g}")
    if not check:
        return 1
    export_artifact(adapter, folder, source={"kind": "custom", "model": "seed001-demo"})
    report = verify_artifact(folder, adapter)
    print(format_verify(report))
    return 0 if report.passed else 1


def output_folder() -> str:
    """OUTPUT_FOLDER from the command line; a wrong command line is one line and exit 2, as in export-onnx."""
    parser = argparse.ArgumentParser(description="Check the adapter, export the demo model and verify the export.")
    parser.add_argument("folder", nargs="?", default="artifacts/seed001-demo", metavar="OUTPUT_FOLDER")
    parser.error = lambda message: parser.exit(2, f"error: {message} (see '{parser.prog} --help')\n")
    return parser.parse_args().folder


if __name__ == "__main__":
    folder = output_folder()
    try:
        sys.exit(main(folder))
    except (ToolkitError, ModelError) as exc:  # the toolkit's errors name the problem and the fix: show them alone
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
