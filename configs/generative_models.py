"""Tiny random-config generative models for configs/generative.yaml: decoder language models
built from a config (no download), with a fixed seed, so every build has the same weights.

eos is switched off: a random model may emit its eos token at once, and the fleet checks
`max_new_tokens` tokens of greedy generation.
"""

from __future__ import annotations

from typing import Any

DECODER = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)


def _tiny(model_class: Any, config_class: Any, seed: int, **overrides: Any) -> Any:
    import torch

    torch.manual_seed(seed)
    model = model_class(config_class(**{**DECODER, **overrides}))
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.eval()


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """LlamaForCausalLM with 2 layers of width 32 and a 128-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaForCausalLM, LlamaConfig, seed, **overrides)


def tiny_qwen2(seed: int = 0, **overrides: Any) -> Any:
    """Qwen2ForCausalLM with 2 layers of width 32 and a 128-token vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _tiny(Qwen2ForCausalLM, Qwen2Config, seed, **overrides)


def tiny_t5(seed: int = 0, **overrides: Any) -> Any:
    """T5ForConditionalGeneration (an encoder-decoder) with 2 encoder and 2 decoder layers of width
    32 and a 128-token vocabulary. Its components: the encoder (`encoder`, which generate() calls
    once for `encoder_outputs`), the decoder's first step (`prefill`) and its later steps (`decode`)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(T5Config(**{**config, **overrides}))
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.eval()


def tiny_gemma(seed: int = 0, **overrides: Any) -> Any:
    """GemmaForCausalLM with 2 layers of width 32 (heads of 8) and a 128-token vocabulary. Weights
    drawn wider than Gemma's default (initializer_range 0.5, not 0.02): at the default, a model this
    small greedily repeats one token, which would make token equality a weak check."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return _tiny(GemmaForCausalLM, GemmaConfig, seed, **{"head_dim": 8, "initializer_range": 0.5, **overrides})


def tiny_phi3(seed: int = 0, **overrides: Any) -> Any:
    """Phi3ForCausalLM with 2 layers of width 32 and a 128-token vocabulary."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _tiny(Phi3ForCausalLM, Phi3Config, seed, **{"pad_token_id": 0, **overrides})
