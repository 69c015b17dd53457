"""Hand-written LoRA: y = W x + scaling * B (A x), with B = 0 at the start so a fresh adapter is an exact no-op.

    scaling = alpha / r (LoRA, Hu et al., 2021), or alpha / sqrt(r) when use_rslora: true (rsLoRA, Kalajdzievski, 2023)
Adapters use PEFT's format (adapter_config.json, adapter_model.safetensors): peft and vLLM load ours, we load theirs."""
import hashlib
import json
import math

import torch
import torch.nn as nn
from safetensors.torch import load, save

from minigrpo.run import DEFAULT_TARGETS
from minigrpo.storage import read_bytes

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):  # wraps a frozen nn.Linear; lora_A is (r, in), lora_B is (out, r), as PEFT stores them

    def __init__(self, base: nn.Linear, r: int, alpha: float, use_rslora: bool = False):
        super().__init__()
        self.base, self.r, self.scaling = base, r, alpha / math.sqrt(r) if use_rslora else alpha / r  # rsLoRA, or plain LoRA
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))  # in float32 for any base dtype:
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))  # a tiny update must not round
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # U(+-1/sqrt(in)), like nn.Linear and PEFT

    def forward(self, x):  # x: (..., in)
        y = self.base(x)  # (..., out)
        h = x @ self.lora_A.T if x.dtype == self.lora_A.dtype else LowPrecisionInput.apply(x, self.lora_A)
        return y + ((h * self.scaling) @ self.lora_B.T).to(y.dtype)  # (..., out), scaling the small tensor (..., r)


class LowPrecisionInput(torch.autograd.Function):
    """h = x A^T in float32 for an input x in bf16 or fp16. Autograd would keep x.float() for A's gradient: a float32
    copy of every LoRA layer's input, alive until the backward pass. This keeps x itself, and casts it again there."""

    @staticmethod
    def forward(ctx, x, A):  # x (..., in), A (r, in) float32
        ctx.save_for_backward(x, A)
        return x.to(A.dtype) @ A.T  # (..., r)

    @staticmethod
    def backward(ctx, grad_h):  # (..., r), in A's dtype even if autocast ran the forward in another
        x, A = ctx.saved_tensors
        grad_h, (r, n) = grad_h.to(A.dtype), A.shape
        return ((grad_h @ A).to(x.dtype) if ctx.needs_input_grad[0] else None,  # grad_x
                grad_h.reshape(-1, r).T @ x.reshape(-1, n).to(A.dtype) if ctx.needs_input_grad[1] else None)  # grad_A (r, in)


def inject_lora(model: nn.Module, r: int, alpha: float, targets=DEFAULT_TARGETS, use_rslora: bool = False):
    if not (names := [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]):
        raise ValueError(f"no nn.Linear named any of {list(targets)} in {type(model).__name__}")
    model.requires_grad_(False)  # the LoRA matrices made below are the only trainable parameters
    for name in names:
        model.set_submodule(name, LoRALinear(model.get_submodule(name), r, alpha, use_rslora))


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{PEFT_PREFIX}{name}.lora_{ab}.weight": getattr(layer, f"lora_{ab}").detach()
            for name, layer in lora_layers(model).items() for ab in "AB"}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]):
    """Check and write an adapter of the layers' own rank and scaling (a checkpoint of this run): every layer."""
    if missing := sorted(lora_state_dict(model).keys() - state.keys()):
        raise ValueError(f"adapter does not fit the model: missing {missing[:3]}")
    layer = next(iter(lora_layers(model).values()))
    check_adapter(model, state, layer.r)
    apply_adapter(model, state, layer.r, layer.scaling)


def check_adapter(model: nn.Module, state: dict[str, torch.Tensor], r: int):
    """Read-only: ValueError unless each tensor belongs to a LoRA layer, fits rank r <= the layer's, and is finite."""
    layers = lora_layers(model)
    if unknown := sorted(state.keys() - lora_state_dict(model).keys()):
        raise ValueError(f"expected target modules in {sorted({n.split('.')[-1] for n in layers})} but received {unknown[:3]}. "
                         "Please verify that the loaded LoRA module is correct")
    for name, layer in layers.items():
        got = [None if (w := state.get(f"{PEFT_PREFIX}{name}.lora_{ab}.weight")) is None else tuple(w.shape) for ab in "AB"]
        if got != [None, None] and (r > layer.r or got != [(r, layer.base.in_features), (layer.base.out_features, r)]):
            raise ValueError(f"{name}: lora_A {got[0]} and lora_B {got[1]} do not fit rank {r} of a "
                             f"{layer.base.in_features}->{layer.base.out_features} layer")
    if bad := [k for k, v in state.items() if not bool(torch.isfinite(v).all())]:
        raise ValueError(f"{bad[0]} holds NaN or infinite values")


def apply_adapter(model: nn.Module, state: dict[str, torch.Tensor], r: int, scaling: float):
    """Write an adapter that check_adapter passed, zero-padded to the layers' rank; layers it does not cover go off."""
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            A, B = (state.get(f"{PEFT_PREFIX}{name}.lora_{ab}.weight") for ab in "AB")
            layer.lora_A[:], layer.lora_B[:], layer.scaling = 0, 0, scaling
            if A is not None:
                layer.lora_A[:r], layer.lora_B[:, :r] = A, B


def adapter_config(r: int, alpha: float, targets, base_model: str, use_rslora: bool = False) -> dict:
    """The adapter_config.json PEFT writes for a LoRA (vLLM reads r, lora_alpha, target_modules, use_rslora)."""
    return dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model, r=r, lora_alpha=alpha,
                target_modules=sorted(targets), lora_dropout=0.0, bias="none", fan_in_fan_out=False, use_rslora=use_rslora,
                use_dora=False, modules_to_save=None, init_lora_weights=True, inference_mode=True)


def adapter_files(state: dict[str, torch.Tensor], config: dict) -> dict[str, bytes]:
    """A PEFT adapter directory as {file name: bytes}, the weights last: a version is complete once they exist."""
    return {"adapter_config.json": json.dumps(config, indent=2).encode(), "adapter_model.safetensors":
            save({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}, metadata={"format": "pt"})}


def adapter_digest(weights: bytes) -> str:  # policy attribution: names the exact weights that sampled a completion
    return hashlib.sha256(weights).hexdigest()[:16]


def check_config(config: dict) -> tuple[int, float]:
    """(r, scaling) of an adapter_config.json, or ValueError naming the first field vLLM would refuse too."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}.")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a finite number, got {alpha!r}.")
    if config.get("use_dora"):
        raise ValueError("vLLM does not yet support DoRA.")
    if config.get("bias", "none") != "none":
        raise ValueError("Adapter bias is not supported.")
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # the scaling, as LoRALinear's


def read_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config, tensors, digest) of a PEFT adapter directory (a path or a URL), or a ValueError naming the fault."""
    path = path.rstrip("/")
    try:
        config = json.loads(read_bytes(f"{path}/adapter_config.json"))  # absent: a FileNotFoundError naming the file
    except ValueError as e:
        raise ValueError(f"{path}/adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}/adapter_config.json is not a JSON object")
    try:
        weights = read_bytes(f"{path}/adapter_model.safetensors")
    except FileNotFoundError:
        raise ValueError(f"{path} doesn't contain tensors") from None
    try:
        return config, load(weights), adapter_digest(weights)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error type for a corrupt file
        raise ValueError(f"{path}/adapter_model.safetensors cannot be read: {e}") from None


def load_adapter(model: nn.Module, path: str) -> str:
    """Load a PEFT adapter directory into a model that inject_lora() wrapped, as a replica does; returns its digest."""
    config, state, digest = read_adapter(path)
    r, scaling = check_config(config)
    check_adapter(model, state, r)
    apply_adapter(model, state, r, scaling)
    return digest
