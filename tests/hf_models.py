"""Models nobody on the team wrote: transformers architectures with tiny random configs (no
download: the config is built here, the weights are random)."""

from __future__ import annotations

import torch
from torch import nn


def bert_tiny() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def gpt2_tiny() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=1, n_head=2, use_cache=False)
    return GPT2LMHeadModel(config).eval()


def distilbert_tiny() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    return DistilBertModel(config).eval()


def roberta_tiny() -> nn.Module:
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=72,
    )
    return RobertaModel(config).eval()


def hf_resnet() -> nn.Module:
    """A tiny random-weight ResNet from transformers (nobody on the team wrote it): with a batch
    of 1-16 its ExecuTorch program plans memory for batch 15 and refuses 16, which the runtime
    says only in its own log (docs/architecture.md §6)."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return ResNetModel(config).eval()
