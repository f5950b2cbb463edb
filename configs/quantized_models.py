"""Models of configs/quantized.yaml that demo_models.py does not have: a small transformers text
classifier, built from a config (no download) with a fixed seed, so every build has the same
weights."""

from __future__ import annotations

from typing import Any


def tiny_bert_classifier(seed: int = 0, labels: int = 4) -> Any:
    """BertForSequenceClassification: 2 layers of width 64, a 512-token vocabulary, `labels` classes."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        num_labels=labels,
    )
    return BertForSequenceClassification(config).eval()
