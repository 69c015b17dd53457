"""The vLLM-compatible server as a real process: the shapes, statuses and messages of vLLM's HTTP API that it
implements, and a 4xx with a JSON body naming the field for every bad input, without harm to anyone else.

    python -m pytest -q tests/test_serve.py
"""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import call, file_digest, free_port, raw_authorization, save_random_adapter, start

from minigrpo import protocol as P
from minigrpo.engine import SamplingParams, TorchEngine

KEY = "test-key"
PROMPT = [2, 3, 11, 4, 5, 12]  # "12+34=" in the demo tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    proc = start(["-m", "minigrpo.replica.serve", "--port", str(port), "--api_key", KEY, "--max_lora_rank", "16", "--seed", "0",
                  "--max_cpu_loras", "2"], port)
    yield f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("adapters"), proc.pid
    proc.kill()


def post(server, path, body, **kw):
    return call("POST", server[0] + path, body, key=KEY, **kw)


def test_completion_has_vllms_shape(server):
    status, _, out = post(server, "/v1/completions", {"prompt": PROMPT, "n": 3, "max_tokens": 5, "logprobs": 0,
                                                      "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200 and out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["model"] == "demo" and [c["index"] for c in out["choices"]] == [0, 1, 2]
    for key in ("service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params", "metrics"):
        assert key in out and out[key] is None
    for c in out["choices"]:
        lp = c["logprobs"]
        assert c["prompt_token_ids"] == PROMPT and c["finish_reason"] in ("stop", "length")
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert len(lp["token_logprobs"]) == len(c["token_ids"]) and all(x <= 0 for x in lp["token_logprobs"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert all(len(top) == 1 for top in lp["top_logprobs"])
        if c["finish_reason"] == "stop":
            assert c["token_ids"][-1] == 0 and c["stop_reason"] is None  # EOS: last id, no stop_reason
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)  # once per prompt, as vLLM counts, whatever n is
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_each_request_gets_the_alternatives_it_asked_for_whatever_it_was_batched_with(server):
    def ask(k):  # sent together, so that requests asking for different numbers share a batch
        return k, post(server, "/v1/completions", {"prompt": PROMPT, "n": 4, "max_tokens": 5, "logprobs": k})[2]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, [0, 5, 1, 3] * 2))
    for k, out in answers:
        for c in out["choices"]:
            assert all(k <= len(top) <= k + 1 for top in c["logprobs"]["top_logprobs"])  # the sampled one + k


def test_batched_prompts_are_prompt_major_and_stop_token_ids_set_stop_reason(server):
    stops = list(range(1, 13))  # every digit and sign: each completion stops at its first token
    status, _, out = post(server, "/v1/completions", {"prompt": [PROMPT, PROMPT[:3]], "n": 2, "max_tokens": 4,
                                                      "stop_token_ids": stops, "return_token_ids": True})
    assert status == 200 and len(out["choices"]) == 4
    assert [c["prompt_token_ids"] for c in out["choices"]] == [PROMPT, PROMPT, PROMPT[:3], PROMPT[:3]]
    for c in out["choices"]:
        if c["token_ids"][-1] != 0:
            assert c["finish_reason"] == "stop" and c["stop_reason"] == c["token_ids"][-1] and c["text"] == ""


def test_seeded_requests_repeat_and_max_tokens_defaults_to_16(server):
    body = {"prompt": PROMPT, "max_tokens": None, "seed": 7, "return_token_ids": True}
    a, b = post(server, "/v1/completions", body)[2], post(server, "/v1/completions", body)[2]
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert len(a["choices"][0]["token_ids"]) <= 16


def test_unknown_model_is_404_with_the_valid_aliases(server):
    status, _, out = post(server, "/v1/completions", {"prompt": PROMPT, "model": "nope"})
    assert status == 404 and out["error"] == {"message": "The model `nope` does not exist. Valid aliases: demo.",
                                              "type": "NotFoundError", "param": "model", "code": 404}


@pytest.mark.parametrize("body, match", [({"prompt": []}, "non-empty"), ({"prompt": [1, -2]}, "out of vocabulary"),
                                         ({"prompt": [1, 999]}, "out of vocabulary"), ({"prompt": PROMPT, "n": 10**6}, "n must"),
                                         ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
                                         ({"prompt": PROMPT, "logprobs": -3}, "logprobs"),
                                         ({"prompt": [1] * 100}, "maximum context length")])
def test_bad_completion_requests_get_400_and_a_reason(server, body, match):
    status, _, out = post(server, "/v1/completions", body)
    assert status == 400 and match in out["error"]["message"] and out["error"]["code"] == 400


def test_malformed_json_and_unknown_routes(server):
    assert post(server, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert call("GET", server[0] + "/v1/nothing", key=KEY)[:1] == (404,)


def test_key_guards_the_v1_routes_only_as_vllm_does(server):
    assert call("GET", server[0] + "/v1/models")[:3] == (401, '{"error": "Unauthorized"}', {"error": "Unauthorized"})
    assert call("GET", server[0] + "/v1/models", key="wrong")[0] == 401
    for path in ("/health", "/ping", "/is_paused", "/get_world_size"):
        assert call("GET", server[0] + path)[0] == 200, path


def test_version_and_ping_answer(server):
    assert call("GET", server[0] + "/version")[2] == {"version": "0.33.0+minigrpo"}
    assert call("GET", server[0] + "/ping")[:2] == (200, "") and call("POST", server[0] + "/ping")[0] == 200


def test_lora_load_errors_follow_vllm(server, tmp_path):
    url = "/v1/load_lora_adapter"
    assert post(server, url, {"lora_name": "", "lora_path": "/x"})[2]["error"]["message"] == \
        "Both 'lora_name' and 'lora_path' must be provided."
    status, _, out = post(server, url, {"lora_name": "a", "lora_path": str(tmp_path / "missing")})
    assert status == 404 and out["error"]["message"].startswith("Loading lora a failed: No adapter found for")
    save_random_adapter(tmp_path / "big", r=32, alpha=32)
    status, _, out = post(server, url, {"lora_name": "big", "lora_path": str(tmp_path / "big")})
    assert status == 500 and out["error"]["message"] == \
        "Call to add_lora method failed: LoRA rank 32 is greater than max_lora_rank 16."
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}')
    status, _, out = post(server, url, {"lora_name": "empty", "lora_path": str(tmp_path / "empty")})
    assert status == 500 and "doesn't contain tensors" in out["error"]["message"]
    assert post(server, url, {"lora_name": "demo", "lora_path": str(tmp_path)})[2]["error"]["message"] == \
        "The lora adapter 'demo' conflicts with a served base model."
    assert post(server, url, {"lora_name": "rel", "lora_path": "relative/dir"})[0] == 400
    status, _, out = post(server, url, {"lora_name": "u", "lora_path": "memory://bucket/policy-v000001"})
    assert status == 404 and P.NO_ADAPTER in out["error"]["message"]  # a URL is read by lora.read_adapter
    assert post(server, url, None, raw=b"lora_name=x", content_type="text/plain")[0] == 400


def test_loaded_adapter_serves_exactly_its_weights(server):
    path = server[1] / "a1"
    local = save_random_adapter(path, r=2, alpha=4, seed=3)
    status, text, _ = post(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(path)})
    assert status == 200 and text == "Success: LoRA adapter 'a1' added successfully."
    status, _, out = post(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(path)})
    assert status == 400 and out["error"]["message"] == ("The lora adapter 'a1' has already been loaded. If you want "
                                                          "to load the adapter in place, set 'load_inplace' to True.")
    body = {"prompt": PROMPT, "model": "a1", "n": 4, "max_tokens": 4, "seed": 11, "logprobs": 0, "return_token_ids": True}
    status, _, out = post(server, "/v1/completions", body)
    assert status == 200 and out["model"] == "a1"
    engine = TorchEngine(local, [0], 0)
    mine = engine.generate([PROMPT], SamplingParams(n=4, max_tokens=4, seed=11))[0]
    assert [c["token_ids"] for c in out["choices"]] == [c.token_ids for c in mine]
    for c, m in zip(out["choices"], mine):
        torch.testing.assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), torch.tensor(m.logprobs), atol=1e-4, rtol=0)
    models = call("GET", server[0] + "/v1/models", key=KEY)[2]["data"]
    assert models[0]["id"] == "demo" and models[0]["max_model_len"] == 64
    card = next(m for m in models if m["id"] == "a1")
    assert card["root"] == str(path) and card["parent"] == "demo" and card["max_model_len"] is None


def test_unload_follows_vllm(server):
    save_random_adapter(server[1] / "u1")
    post(server, "/v1/load_lora_adapter", {"lora_name": "u1", "lora_path": str(server[1] / "u1")})
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "u1"})[:2] == \
        (200, "Success: LoRA adapter 'u1' removed successfully.")
    status, _, out = post(server, "/v1/unload_lora_adapter", {"lora_name": "u1"})
    assert status == 404 and out["error"]["message"] == "The lora adapter 'u1' cannot be found."
    assert post(server, "/v1/unload_lora_adapter", {})[2]["error"]["message"] == \
        "'lora_name' needs to be provided to unload a LoRA adapter."
    assert post(server, "/v1/completions", {"prompt": PROMPT, "model": "u1"})[0] == 404


def test_pause_modes_and_server_info(server):
    assert post(server, "/pause?mode=sideways", None)[0] == 400
    assert post(server, "/pause?mode=abort", None)[2] == {"status": "paused"}
    assert call("GET", server[0] + "/is_paused", key=KEY)[2] == {"is_paused": True}
    status, _, out = post(server, "/v1/completions", {"prompt": PROMPT})
    assert status == 503 and out["error"]["message"] == "Generation is paused. Please retry after it resumes."
    assert post(server, "/pause?mode=keep", None)[0] == 200
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions", {"prompt": PROMPT})))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "with mode=keep a new request waits for /resume"
    assert post(server, "/resume", None)[2] == {"status": "resumed"}
    waiter.join(30)
    assert result["r"][0] == 200
    info = call("GET", server[0] + "/server_info?config_format=json", key=KEY)[2]["vllm_config"]
    assert info["lora_config"]["max_lora_rank"] == 16 and info["parallel_config"]["data_parallel_size"] == 1
    assert isinstance(call("GET", server[0] + "/server_info", key=KEY)[2]["vllm_config"], str)
    assert post(server, "/reset_prefix_cache", None)[2] == {"success": True}


@pytest.mark.parametrize("key, raw", [("lora_path", b'"/tmp/a\\u0000b"'), ("lora_name", b'"a\\udcff"'),
                                      ("lora_name", b'"a\\r\\nX-Injected: 1"')])
def test_nul_newline_or_a_lone_surrogate_in_a_lora_field_is_a_400_naming_it(server, key, raw):
    body = {"lora_name": b'"x"', "lora_path": f'"{server[1]}"'.encode()} | {key: raw}
    status, _, out = post(server, "/v1/load_lora_adapter", None,
                          raw=b'{"lora_name": %s, "lora_path": %s}' % (body["lora_name"], body["lora_path"]))
    assert status == 400 and out["error"] == {"message": f"{key} must be printable text",
                                              "type": "InvalidUserInput", "param": key, "code": 400}


def test_authorization_bytes_that_are_not_utf8_get_a_json_401(server):
    assert raw_authorization(server[0] + "/v1/models", b"Bearer \xff\xfe") == (401, {"error": "Unauthorized"})


def broken_adapters(root) -> dict:
    """name -> (path, the reason the load is refused with). Each starts as a valid adapter, then one thing breaks."""
    from safetensors.torch import load_file, save_file
    cases = {}

    def make(name, message, config=None, tensors=None):
        path = root / name
        save_random_adapter(path, r=2, alpha=4, seed=1)
        if config:
            c = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps(c | config))
        if tensors:
            weights = path / "adapter_model.safetensors"
            save_file(tensors(load_file(weights)), weights)
        cases[name] = (path, message)

    first_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    make("r0", "LoRA rank r must be an integer >= 1, got 0.", config={"r": 0})
    make("inf_alpha", "lora_alpha must be a finite number, got inf.", config={"lora_alpha": float("inf")})
    make("dora", "vLLM does not yet support DoRA.", config={"use_dora": True})
    make("nan", f"{first_a} holds NaN or infinite values", tensors=lambda t: t | {first_a: t[first_a] * float("nan")})
    make("shape", "model.layers.0.self_attn.q_proj: lora_A (2, 5)",
         tensors=lambda t: t | {first_a: torch.zeros(2, 5)})
    make("module", "expected target modules in", tensors=lambda t: t | {
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(2, 4)})
    return cases


def seeded(server, model):
    status, _, out = post(server, "/v1/completions", {"prompt": PROMPT, "model": model, "n": 3, "max_tokens": 6,
                                                      "seed": 5, "logprobs": 0, "return_token_ids": True})
    assert status == 200
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in out["choices"]]


def test_refused_adapters_leave_the_active_one_serving_exactly_as_before(server, tmp_path):
    save_random_adapter(tmp_path / "steady", r=2, alpha=4, seed=4)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "steady", "lora_path": str(tmp_path / "steady")})[0] \
        == 200
    before = seeded(server, "steady")
    for name, (path, message) in broken_adapters(tmp_path).items():
        status, _, out = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert status == 500 and out["error"]["message"].startswith(f"Call to add_lora method failed: {message}"), name
        assert post(server, "/v1/completions", {"prompt": PROMPT, "model": name})[0] == 404
    assert seeded(server, "steady") == before


def test_an_evicted_adapter_is_checked_again_when_it_is_read_back(server, tmp_path):
    for i in range(3):  # --max_cpu_loras 2: e0 leaves the cache
        save_random_adapter(tmp_path / f"e{i}", seed=10 + i)
        body = {"lora_name": f"e{i}", "lora_path": str(tmp_path / f"e{i}")}
        assert post(server, "/v1/load_lora_adapter", body)[0] == 200
    before = seeded(server, "e1")
    from safetensors.torch import load_file, save_file
    weights = tmp_path / "e0" / "adapter_model.safetensors"
    save_file({k: v * float("nan") for k, v in load_file(weights).items()}, weights)
    status, _, out = post(server, "/v1/completions", {"prompt": PROMPT, "model": "e0"})
    assert status == 500 and "holds NaN or infinite values" in out["error"]["message"]
    assert seeded(server, "e1") == before


def test_every_choice_names_the_adapter_and_the_digest_of_its_file(server):
    path = server[1] / "att"
    save_random_adapter(path, seed=8)
    post(server, "/v1/load_lora_adapter", {"lora_name": "att", "lora_path": str(path)})
    for model, digest in (("att", file_digest(path)), ("demo", "")):
        status, _, out = post(server, "/v1/completions", {"prompt": PROMPT, "model": model, "n": 2, "max_tokens": 3})
        assert status == 200 and (call.headers["X-Adapter-Name"], call.headers["X-Adapter-Digest"]) == (model, digest)
        assert all((c["adapter"], c["adapter_digest"]) == (model, digest) for c in out["choices"])


def test_an_rslora_adapter_is_served_scaled_by_alpha_over_sqrt_r(server):
    path = server[1] / "rs"
    local = save_random_adapter(path, r=4, alpha=8, seed=6, use_rslora=True)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": str(path)})[0] == 200
    mine = TorchEngine(local, [0], 0).generate([PROMPT], SamplingParams(n=3, max_tokens=6, seed=5))[0]
    served = seeded(server, "rs")
    assert [ids for ids, _ in served] == [c.token_ids for c in mine]
    for (_, lps), m in zip(served, mine):
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(m.logprobs), atol=1e-4, rtol=0)


def test_max_cpu_loras_bounds_the_memory_adapters_hold(server, tmp_path):
    """150 loads of rank-16 adapters (267 KiB each, 39 MiB in all) under --max_cpu_loras 2 keep at most 2 in memory."""
    status = lambda: open(f"/proc/{server[2]}/status").read()
    rss_mb = lambda: int(status().split("VmRSS:")[1].split()[0]) / 1024
    for i in range(2):
        save_random_adapter(tmp_path / f"m{i}", r=16, alpha=16, seed=i)
    before = rss_mb()
    for i in range(150):
        body = {"lora_name": f"m{i}", "lora_path": str(tmp_path / f"m{i % 2}")}
        assert post(server, "/v1/load_lora_adapter", body)[0] == 200
    assert rss_mb() - before < 15
    for i in range(150):
        post(server, "/v1/unload_lora_adapter", {"lora_name": f"m{i}"})
