"""Shared fixtures: tiny randomly initialised causal LMs built locally (nothing is downloaded)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(arch: str = "qwen2", seed: int = 0, vocab: int = 32):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return model_cls(config).eval()


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param
