"""Loading a causal LM and its tokenizer, and the token log-probabilities the loss is computed from. `--model demo` is
the tiny model in minigrpo/demo_model (minigrpo/tools/demo.py); any other name is a local folder or a Hugging Face repo id."""
import os

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, logging as hf_logging
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def packed_attention(module, query, key, value, attention_mask, packed_plan=None, **kwargs):
    """transformers' SDPA, but a packed row with a plan (plan_packed_row) runs per sequence, causal, the k runs of one length
    in one call (no N x N mask); a run from position q > 0 is a branch: it also sees its sequence's first q tokens (a prompt)."""
    if packed_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = lambda x, i: x[0][:, i].transpose(0, 1)  # noqa: E731 (heads, N, d) -> (k, heads, len, d)
    out = query.new_empty(query.shape[2], query.shape[1], value.shape[3])  # (N, heads, head_dim)
    for idx, keys, mask in packed_plan:
        part = sdpa_attention_forward(module, rows(query, idx), rows(key, keys), rows(value, keys), mask, **kwargs)[0]
        out[idx.flatten()] = part.flatten(0, 1)  # part (k, L, heads, d)
    return out[None], None


def plan_packed_row(position_ids: torch.Tensor, dev) -> list[tuple]:
    """Packed position ids (1, N) -> per run length L (on a GPU, and prefix q): the runs' tokens (k, L), keys, mask."""
    pos, runs = position_ids[0].tolist(), {}  # runs: (L, q or 0) -> [(start, q, start of its sequence)]
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
    for s, e in zip(starts, starts[1:] + [len(pos)]):
        if (q := pos[s]) == 0:
            seq, first = s, e - s  # a new sequence: its first run holds what its branches share
        elif q > first:
            raise ValueError(f"packed row: the run at token {s} shares {q} tokens, its sequence's first run has {first}")
        runs.setdefault((e - s, q if dev.type in FLAG_DEVICES else 0), []).append((s, q, seq))
    return [run_plan(L, spans, dev) for (L, _), spans in runs.items()]


FLAG_DEVICES = ("cuda",)  # where SDPA's kernels take a lower-right causal flag; elsewhere it would be made a mask


def run_plan(L: int, spans: list[tuple], dev):  # spans: the runs of length L, (start, q, start of its sequence)
    s, q, seq = torch.tensor(spans, device=dev).T[..., None]  # (k, 1) each
    idx, Q = s + torch.arange(L, device=dev), max(span[1] for span in spans)  # idx (k, L): the runs' own tokens
    if not Q:
        return idx, idx, None
    prefix = torch.arange(Q, device=dev) - (Q - q)  # (k, Q) the shared prefixes first, right-aligned: < 0 is padding
    keys = torch.cat([seq + prefix.clamp(min=0), idx], 1)  # (k, Q + L)
    if dev.type in FLAG_DEVICES:  # every run shares Q tokens: query i sees keys 0..Q + i, as a flag (flash kernels too)
        return idx, keys, causal_lower_right(L, Q + L)
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril().expand(len(s), L, L)  # a dense mask, shared by layers
    return idx, keys, torch.cat([(prefix >= 0)[:, None].expand(-1, L, -1), causal], 2)[:, None]  # (k, 1, L, Q + L)


PACKED_SDPA = "minigrpo_packed_sdpa"  # load_model's attention: SDPA that also runs packed rows per sequence
AttentionInterface.register(PACKED_SDPA, packed_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # as SDPA's, for the engine's padded batches


def resolve_model(name: str) -> str:
    return DEMO_MODEL if name == "demo" else name


def pick_device(device: str = "auto") -> torch.device:  # train.py's torchrun ranks bind cuda:LOCAL_RANK themselves
    auto = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    return torch.device(auto if device == "auto" else device)


def load_model(name: str, device: torch.device, dtype: str = "float32"):
    hf_logging.disable_progress_bar()  # one clean log line per step, no bars
    tokenizer = AutoTokenizer.from_pretrained(path := resolve_model(name))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=PACKED_SDPA)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model.to(device).eval().requires_grad_(False), tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from both the tokenizer and generation_config (instruct models often list several)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})


CHUNK_LOGITS = 2**23  # logits computed at once by the output head: 32 MiB in float32


class HeadLogprobs(torch.autograd.Function):
    """Token log-probs and entropies through a frozen output head W (V, H), a chunk of tokens at a time:

        z_t = (h_t W^T) / T,   logp_t = z_t[y_t] - logsumexp(z_t),   entropy_t = logsumexp(z_t) - sum_v p_tv z_tv

    W is frozen, so d logp_t / d h_t = (W[y_t] - p_t W) / T depends on nothing downstream: computed in the forward
    pass, it is only scaled by d loss / d logp_t in the backward. No (tokens x vocab) tensor outlives its chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float):  # hidden (N, H), weight (V, H), targets (N,)
        N, chunk, ctx.dtype = len(hidden), max(1, CHUNK_LOGITS // len(weight)), hidden.dtype  # ctx.dtype: grad_h's
        logp, entropy = hidden.new_empty(N, dtype=torch.float32), hidden.new_empty(N, dtype=torch.float32)
        grad = hidden.new_empty(N, hidden.shape[1], dtype=torch.float32) if ctx.needs_input_grad[0] else None
        out = hidden.new_empty(min(chunk, N), len(weight))  # (chunk, V) buffers that all chunks reuse (fresh ones
        p_buf = torch.empty_like(out, dtype=torch.float32)  # fragment the heap, raise the peak): head output in its dtype, p, z
        z_buf = out if out.dtype == torch.float32 else torch.empty_like(p_buf)
        for s in range(0, N, chunk):
            y, c = targets[s:s + chunk], min(chunk, N - s)  # (c,)
            z = z_buf[:c].copy_(torch.matmul(hidden[s:s + chunk], weight.T, out=out[:c])).div_(temperature)  # (c, V)
            top = z.amax(-1, keepdim=True)  # (c, 1)
            p = torch.sub(z, top, out=p_buf[:c]).exp_()  # (c, V), not yet normalised
            p /= (total := p.sum(-1, keepdim=True))  # (c, V) the softmax, total (c, 1)
            lse = (top + total.log()).squeeze(1)  # (c,) logsumexp(z)
            logp[s:s + chunk] = z.gather(1, y[:, None]).squeeze(1) - lse
            entropy[s:s + chunk] = lse - (p[:, None] @ z[:, :, None]).view(c)  # sum_v p z without a (c, V) product
            if grad is not None:
                p.scatter_add_(1, y[:, None], p.new_full((c, 1), -1.0))  # p - onehot(y) = -d logp / d z, on the device
                p_w = p if out.dtype == torch.float32 else out[:c].copy_(p)  # in the head's dtype, into its buffer
                grad[s:s + chunk] = -(p_w @ weight).float() / temperature  # (c, H)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        return (grad_logp[:, None] * ctx.saved_tensors[0]).to(ctx.dtype), None, None, None


def output_head(model) -> torch.nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or (head.weight.requires_grad and torch.is_grad_enabled()):
        raise ValueError(f"the log-probs need a frozen bias-free linear output head, got {head}")
    return head


def packed_logprobs(model, ids, pos, where, targets, temperature: float):  # ids..targets: a row from packing.collate
    """log pi(y_t | y_<t) (logits / temperature, float32, with gradient) and entropy, (B, T) each, 0 past the end."""
    if (attn := model.config._attn_implementation) != PACKED_SDPA:
        raise ValueError(f"packed rows need attn_implementation={PACKED_SDPA!r} (load_model sets it), the model has {attn!r}")
    dev, no_mask = ids.device, ids.new_ones(1, 1, 1, 1, dtype=torch.bool)  # 4-D: transformers makes no mask, reads nothing
    hidden = model.base_model(input_ids=ids, position_ids=pos.to(dev), attention_mask=no_mask, use_cache=False,
                              packed_plan=plan_packed_row(pos, dev)).last_hidden_state[0]  # (N, H); pos is on the host
    at = (targets >= 0).flatten().nonzero().flatten()  # (n,) the completion tokens' flat (B, T) indices
    y, rows, at = targets.flatten()[at].to(dev), where.flatten()[at].to(dev), at.to(dev)
    return tuple(torch.zeros(where.numel(), device=dev).index_put((at,), x).view(where.shape)  # (B, T): logp, entropy
                 for x in HeadLogprobs.apply(hidden[rows], output_head(model).weight, y, temperature))
