"""Clients nobody here wrote, against a replica behind a keyless loopback proxy (the setup TRL's VLLMClient needs,
since it sends no key): the `openai` package, and `requests` sending the exact requests TRL's async GRPO makes.

    python -m pytest -q tests/test_clients.py
"""
import json
import shutil

import openai
import pytest
import requests
from conftest import ROOT, file_digest, free_port, save_random_adapter, start

PROMPT = [2, 3, 11, 4, 5, 12]  # "12+34="
MESSAGES = [{"role": "user", "content": "12+34="}]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    replica, port = free_port(), free_port()
    procs = [start(["-m", "minigrpo.replica.serve", "--port", str(replica)], replica),
             start(["proxy.py", "--upstream", f"http://127.0.0.1:{replica}", "--port", str(port), "--no_auth"], port)]
    yield f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("adapters")
    for p in procs:
        p.kill()


@pytest.fixture
def client(proxy):
    with openai.OpenAI(base_url=proxy[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_openai_completions_count_the_prompt_once_and_return_logprobs(client):
    out = client.completions.create(model="demo", prompt="12+34=", max_tokens=4, n=3, seed=1, logprobs=2)
    assert out.usage.prompt_tokens == 6 and len(out.choices) == 3
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    assert all(len(top) <= 3 for c in out.choices for top in c.logprobs.top_logprobs)


def test_openai_chat_uses_the_chat_template(client):
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, seed=1, logprobs=True,
                                         top_logprobs=2)
    assert out.object == "chat.completion" and out.usage.prompt_tokens == 6  # "12+34=" after the template
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_openai_stop_strings_cut_the_text(client):
    out = client.completions.create(model="demo", prompt="12+34=", max_tokens=8, n=4, seed=3, stop=["4", "6"])
    reasons = [c.model_extra["stop_reason"] for c in out.choices]
    assert set(reasons) & {"4", "6"}, "the demo model answers 46: some sample meets a stop string"
    for c, reason in zip(out.choices, reasons):
        assert "4" not in c.text and "6" not in c.text
        assert reason not in ("4", "6") or c.finish_reason == "stop"


def test_openai_errors_carry_status_message_and_param(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt="1", max_tokens=2, extra_body={"top_k": 5})
    assert bad.value.status_code == 400 and bad.value.param == "top_k"
    assert bad.value.message.endswith("top_k=5 is not supported by this server")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="1", max_tokens=2)
    assert [m.id for m in client.models.list()] == ["demo"]


def test_chat_without_a_template_is_a_400_as_in_vllm(tmp_path):
    model = tmp_path / "no_template"
    shutil.copytree(f"{ROOT}/minigrpo/demo_model", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    port = free_port()
    proc = start(["-m", "minigrpo.replica.serve", "--model", str(model), "--port", str(port)], port)
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="default chat template is no longer allowed"):
                c.chat.completions.create(model=str(model), messages=MESSAGES, max_tokens=2)
    finally:
        proc.kill()


def test_trl_async_grpo_requests_work_through_a_keyless_proxy(proxy):
    """The calls TRL 1.16's VLLMClient and rollout worker make, in their order and with their bodies."""
    url, path = proxy[0], proxy[1] / "trl-policy-v1"
    save_random_adapter(path, seed=5)
    s = requests.Session()
    assert s.get(f"{url}/health").status_code == 200
    info = s.get(f"{url}/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["lora_config"]["max_loras"] >= 6 and info["parallel_config"]["data_parallel_size"] == 1
    assert info["model_config"]["dtype"] == "torch.float32"  # VLLMClient.get_dtype() reads it
    assert s.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 64
    assert s.post(f"{url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    load = {"lora_name": "trl-policy-v1", "lora_path": str(path), "load_inplace": False}
    assert s.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 200
    assert s.post(f"{url}/resume").json() == {"status": "resumed"}
    body = {"model": "trl-policy-v1", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "repetition_penalty": 1.0, "min_p": 0.0, "n": 1, "return_token_ids": True, "logprobs": 0,
            "seed": 2**62 + 5}
    r = s.post(f"{url}/v1/completions", json=body)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    assert r.headers["X-Adapter-Digest"] == choice["adapter_digest"] == file_digest(path)
    assert s.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"}).status_code == 200
    assert s.get(f"{url}/get_world_size").json() == {"world_size": 1}
