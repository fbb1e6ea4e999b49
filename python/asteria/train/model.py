"""OLMo-2 decoders (HF transformers' ``Olmo2ForCausalLM``, random init) in the sizes the CLI trains.

A preset fixes the transformer body (width, depth, heads, MLP width, RoPE, norms). The vocabulary is
the tokenizer's: 256 for the default byte-level tokenizer, the tokenizer's size (rounded up to a
multiple of 128) for a HF tokenizer. The names give the size at OLMo's own vocabulary
(``reference_vocab``); with bytes the embedding and output layers are much smaller, the body is the
same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_seq_len: int
    reference_vocab: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-6


# olmo-160m and olmo-660m: OLMo-style shapes with head dim 64 and a SwiGLU width of about 8/3 of the
# model width; 162M and 664M parameters at OLMo-1's 50304-token vocabulary (untied embeddings).
# olmo2-1b: allenai/OLMo-2-0425-1B's shapes (2048 wide, 16 layers and heads, MLP 8192, 100352 tokens).
PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512, max_seq_len=256,
                        reference_vocab=256, rope_theta=10_000.0),
    "olmo-160m": ModelPreset(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048,
                             max_seq_len=2048, reference_vocab=50304),
    "olmo-660m": ModelPreset(hidden_size=1536, num_layers=18, num_heads=24, intermediate_size=4096,
                             max_seq_len=2048, reference_vocab=50304),
    "olmo2-1b": ModelPreset(hidden_size=2048, num_layers=16, num_heads=16, intermediate_size=8192,
                            max_seq_len=4096, reference_vocab=100352),
}


def build_model(preset: str, vocab_size: int, seq_len: int) -> nn.Module:
    """A randomly initialised ``Olmo2ForCausalLM`` of ``preset``'s shape over ``vocab_size`` tokens."""
    if preset not in PRESETS:
        raise ValueError(f"Invalid model={preset!r}: must be one of {tuple(PRESETS)}")
    shape = PRESETS[preset]
    if seq_len > shape.max_seq_len:
        raise ValueError(f"Invalid seq_len={seq_len}: model {preset!r} takes at most {shape.max_seq_len} tokens")
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads, max_position_embeddings=shape.max_seq_len,
        rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=False,
        attention_dropout=0.0, initializer_range=0.02, use_cache=False,
        # The byte tokenizer has no special tokens; training needs none (fixed-length packing).
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    return CausalLM(Olmo2ForCausalLM(config))


class CausalLM(nn.Module):
    """A causal LM with ``loss(batch)`` over (B, T + 1) token windows (next-token cross entropy in
    float32, whatever the autocast dtype)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def vocab_size(self) -> int:
        return self.lm.config.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(batch[:, :-1]), batch)


def next_token_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (float32) of ``logits`` over ``batch[:, :-1]`` against ``batch[:, 1:]``.
    ``CausalLM.loss`` is this over its own logits; a wrapped model (DDP) computes its logits through the
    wrapper and the loss here."""
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a ``CausalLM`` (FSDP2 shards each one as a unit)."""
    return model.lm.model.layers


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
