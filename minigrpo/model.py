"""Loading a causal LM and its tokenizer, and the token log-probabilities the loss is computed from.

`--model demo` (the default) is the tiny built-in model shipped in minigrpo/demo_model (made by minigrpo/demo.py);
any other name is a local folder or a Hugging Face repo id, loaded by the same code.
"""
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def resolve_model(name: str) -> str:
    return DEMO_MODEL if name == "demo" else name


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def load_model(name: str, device: torch.device, dtype: str = "float32"):
    """(model in eval mode with frozen weights, tokenizer). dtype: float32 | bfloat16 | float16."""
    path = resolve_model(name)
    hf_logging.disable_progress_bar()  # one clean log line per step, no bars
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    for p in model.parameters():
        p.requires_grad = False
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def enable_checkpointing(model):
    """Recompute activations in the backward pass (transformers 5.24 renamed it; the 5.20 line has the old name)."""
    kwargs = {"use_reentrant": False}  # works with frozen embeddings, no input gradients needed
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from both the tokenizer and generation_config (instruct models often list several)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else {eos}
    return sorted(i for i in ids if i is not None)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float):
    """log pi(x_t | x_<t) for t >= 1 in float32 from logits / temperature, and the per-token entropy.

    input_ids, attention_mask: (B, L) right-padded. Returns logp (B, L-1) with gradient, entropy (B, L-1) without.
    Position t-1 predicts token t, hence the shift by one.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (B, L-1, V)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, L-1, V)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, L-1)
    return logp, entropy
