"""minigrpo's server against real vLLM, request by request: replica 0 of the `replicas` fixture (conftest.py) asked
directly, and minigrpo's server on the same model with the same LoRA flags, given the same requests. The answers
must have vLLM's fields, status codes, error messages and (greedy, or over the whole distribution) numbers.

    .ci/vllm-env && python -m pytest -q tests/test_vllm_parity.py
"""
import json

import requests
from vllm_replicas import MODEL, PROMPT, load, post, random_adapter


def scrub(answer):
    """vLLM writes "<path>" for a path under /tmp (where CI may clone the project), minigrpo the path itself."""
    return json.loads(json.dumps(answer).replace(MODEL + ".", "<path>").replace(MODEL, "<path>"))


def both(pair, method: str, path: str, **kw) -> list:
    """The same request to vLLM and to minigrpo's server (requests, as TRL sends them): [vLLM's, minigrpo's]."""
    return [requests.request(method, url + path, timeout=120, **kw) for url in pair]


def same_shape(a, b, where="") -> list[str]:
    """Where two JSON values differ in their keys or types (not values): [] when they have one shape."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: {'vLLM only' if k in a else 'minigrpo only'}" for k in sorted(a.keys() ^ b.keys())]
        return out + [d for k in sorted(a.keys() & b.keys()) for d in same_shape(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_shape(x, y, f"{where}[{i}]")] + (
            [f"{where}: {len(a)} items in vLLM's, {len(b)} in minigrpo's"] if len(a) != len(b) else [])
    kinds = lambda v: "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__  # noqa: E731
    return [] if a is None or b is None or kinds(a) == kinds(b) else [f"{where}: {kinds(a)} in vLLM's, {kinds(b)} in minigrpo's"]


def close(a: list, b: list, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


GREEDY = {"prompt": PROMPT, "n": 1, "max_tokens": 5, "temperature": 0.0, "logprobs": 2, "return_token_ids": True,
          "seed": 11, "stop_token_ids": [3]}  # greedy "12+34=" is "63" then EOS (0): it stops on EOS
MINIGRPO_ONLY = ("adapter", "adapter_digest")  # policy attribution: minigrpo's own fields in each choice


def completion(pair, body: dict) -> list[dict]:
    answers = both(pair, "POST", "/v1/completions", json=body)
    assert [r.status_code for r in answers] == [200, 200], [r.text[:300] for r in answers]
    return [r.json() for r in answers]


def test_minigrpo_server_answers_greedy_completions_as_vllm_does(pair):
    v, m = completion(pair, GREEDY | {"model": MODEL})
    cv, cm = v["choices"][0], m["choices"][0]
    assert {k: cm[k] for k in cv} == {k: cv[k] for k in cv} | {"logprobs": cm["logprobs"]}  # every field vLLM sends
    assert set(cm) - set(cv) == set(MINIGRPO_ONLY) and cm["prompt_token_ids"] == PROMPT
    assert (cm["logprobs"]["tokens"], cm["logprobs"]["text_offset"]) == (cv["logprobs"]["tokens"], cv["logprobs"]["text_offset"])
    assert [list(t) for t in cm["logprobs"]["top_logprobs"]] == [list(t) for t in cv["logprobs"]["top_logprobs"]]
    assert m["usage"] == v["usage"] and m["model"] == v["model"] == MODEL and m["object"] == v["object"]
    assert set(m) == set(v)


def test_minigrpo_server_greedy_logprobs_are_vllms(pair):
    """vLLM's processed log-probs skip the temperature on the greedy path: log_softmax of the logits, not 0."""
    v, m = completion(pair, GREEDY | {"model": MODEL})
    lv, lm = v["choices"][0]["logprobs"], m["choices"][0]["logprobs"]
    assert close(lm["token_logprobs"], lv["token_logprobs"])
    for tv, tm in zip(lv["top_logprobs"], lm["top_logprobs"]):  # the chosen token first, then the top 2
        assert close(list(tm.values()), list(tv.values()))


def test_minigrpo_server_refuses_several_greedy_choices_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json=GREEDY | {"n": 2})
    assert v.status_code == 400 and v.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
    assert (m.status_code, m.json()["error"]) == (v.status_code, v.json()["error"])


def test_minigrpo_server_refuses_max_tokens_beyond_the_context_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})
    assert (v.status_code, v.json()["error"]["param"]) == (400, "max_tokens")
    assert v.json()["error"]["message"].startswith("max_tokens=100 cannot be greater than max_model_len=64.")
    assert (m.status_code, m.json()["error"]["param"]) == (400, "max_tokens")
    assert m.json()["error"]["message"].startswith("max_tokens=100 cannot be greater than max_model_len=64.")


def test_minigrpo_server_reports_eos_before_a_stop_token_as_vllm_does(pair):
    v, m = (a["choices"][0] for a in completion(pair, GREEDY | {"stop_token_ids": [0]}))
    assert (v["finish_reason"], v["stop_reason"], v["token_ids"][-1]) == ("stop", None, 0)
    assert (m["finish_reason"], m["stop_reason"], m["token_ids"]) == ("stop", None, v["token_ids"])


def test_minigrpo_server_samples_the_same_distribution_as_vllm(pair, tmp_path):
    """At temperature 1 the two draw from different generators, but one token with all 12 alternatives shows the
    whole distribution sampled from: the base model's, then a loaded adapter's."""
    path = random_adapter(tmp_path / "same-weights", seed=10)
    for url in pair:
        assert load(url, "same-weights", path)[0] == 200
    for model in (MODEL, "same-weights"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "logprobs": 12, "seed": 3}
        v, m = (a["choices"][0]["logprobs"]["top_logprobs"][0] for a in completion(pair, body))
        assert sorted(m) == sorted(v) and len(v) >= 12  # the sampled token, then the top 12 of 13
        assert close([m[k] for k in sorted(v)], [v[k] for k in sorted(v)]), (model, v, m)


def test_minigrpo_server_stops_on_a_stop_token_as_vllm_does(pair):
    first = completion(pair, GREEDY)[0]["choices"][0]["token_ids"]
    body = GREEDY | {"stop_token_ids": [first[1]]}  # greedy's second token stops it
    v, m = (a["choices"][0] for a in completion(pair, body))
    assert (m["finish_reason"], m["stop_reason"], m["token_ids"]) == (v["finish_reason"], v["stop_reason"],
                                                                      v["token_ids"]) == ("stop", first[1], first[:2])
    assert m["text"] == v["text"]  # the stop token's text is left out of `text`


def test_minigrpo_server_seeded_sampling_has_vllms_shape_and_repeats_itself(pair):
    """Seeded sampling at temperature 1 repeats on each server; the two draw from different generators, so their
    tokens differ (a known difference: vLLM's per-request torch.Generator and minigrpo's are not the same stream)."""
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 5, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True, "seed": 1234}
    first, again = completion(pair, body), completion(pair, body)
    for a, b in zip(first, again):
        assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    v, m = first
    assert [c["index"] for c in m["choices"]] == [c["index"] for c in v["choices"]] == [0, 1, 2]
    for c in v["choices"] + m["choices"]:  # top_logprobs' keys are the tokens drawn, which differ
        c["logprobs"]["top_logprobs"] = len(c["logprobs"]["top_logprobs"])
    assert not [d for d in same_shape(v, m) if not d.endswith(tuple(f".{k}: minigrpo only" for k in MINIGRPO_ONLY))]


def test_minigrpo_server_chat_completions_match_vllms(pair):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 1}
    rv, rm = both(pair, "POST", "/v1/chat/completions", json=body)
    assert rm.status_code == rv.status_code == 200
    v, m = rv.json()["choices"][0], rm.json()["choices"][0]
    assert (m["message"]["role"], m["message"]["content"], m["finish_reason"]) == \
        (v["message"]["role"], v["message"]["content"], v["finish_reason"])
    assert [(t["token"], t["bytes"]) for t in m["logprobs"]["content"]] == [(t["token"], t["bytes"]) for t in v["logprobs"]["content"]]
    assert rm.json()["usage"] == rv.json()["usage"] and rm.json()["object"] == rv.json()["object"] == "chat.completion"


def test_minigrpo_server_lists_models_and_config_as_vllm_does(pair):
    v, m = (r.json() for r in both(pair, "GET", "/v1/models"))
    base = lambda d: {k: d["data"][0][k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")}  # noqa: E731
    assert base(m) == base(v) == base(v) | {"id": MODEL, "max_model_len": 64}
    v, m = (r.json() for r in both(pair, "GET", "/server_info", params={"config_format": "json"}))
    pick = lambda d: (d["vllm_config"]["model_config"]["dtype"], d["vllm_config"]["model_config"]["max_model_len"],  # noqa: E731
                      d["vllm_config"]["parallel_config"]["data_parallel_size"],
                      {k: d["vllm_config"]["lora_config"][k] for k in ("max_lora_rank", "max_loras", "max_cpu_loras")})
    assert pick(m) == pick(v) == ("torch.float32", 64, 1, {"max_lora_rank": 8, "max_loras": 6, "max_cpu_loras": 8})


def test_minigrpo_server_answers_trls_vllm_client_as_vllm_does(pair):
    """TRL 1.16's VLLMClient (trl/experimental/async_grpo/vllm_client.py): wait_for_server_ready, get_max_model_len,
    get_dtype and get_world_size, as the same requests."""
    answers = []
    for url in pair:
        health = requests.get(f"{url}/health", timeout=5)
        max_model_len = requests.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        dtype = requests.get(f"{url}/server_info", params={"config_format": "json"}).json()["vllm_config"]["model_config"]["dtype"]
        world_size = requests.get(f"{url}/get_world_size").json()["world_size"]
        answers.append((health.status_code, health.text, max_model_len, dtype, world_size))
    assert answers[1] == answers[0] == (200, "", 64, "torch.float32", 1)


def test_minigrpo_server_loads_and_unloads_adapters_as_vllm_does(pair, tmp_path):
    p1, p2 = random_adapter(tmp_path / "d1", seed=7), random_adapter(tmp_path / "d2", seed=8)
    big = random_adapter(tmp_path / "d16", seed=9, r=16)
    results = []
    for url in pair:
        answers = [load(url, "diff", p1), load(url, "diff", p1), load(url, "diff", p2),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "nothing"}), load(url, "", p1),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": ""}), load(url, MODEL, p1),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "diff"}),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "diff"})]
        results.append([(s, body or text) for s, text, body in answers])
        # vLLM writes "<path>" for paths under /tmp and wraps the worker's error; minigrpo names the path as it is
        (missing, _, a), (rank, _, b) = load(url, "diff-missing", tmp_path / "missing"), load(url, "diff-r16", big)
        results[-1] += [(missing, a["error"]["type"], a["error"]["message"].split(" for ")[0]),
                        (rank, b["error"]["type"], "LoRA rank 16 is greater than max_lora_rank 8." in b["error"]["message"])]
    v, m = results
    for i, (a, b) in enumerate(zip(v, m)):
        assert scrub(b) == scrub(a), f"request {i}: vLLM {a}, minigrpo {b}"
    assert v[0] == (200, "Success: LoRA adapter 'diff' added successfully.") and v[1][0] == 400
    assert v[-2:] == [(404, "NotFoundError", "Loading lora diff-missing failed: No adapter found"),
                      (500, "InternalServerError", True)]


def test_minigrpo_server_answers_an_unknown_model_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json={"model": "not-loaded", "prompt": PROMPT, "max_tokens": 2})
    assert (m.status_code, scrub(m.json())) == (v.status_code, scrub(v.json())) and v.status_code == 404


def test_minigrpo_server_refuses_a_bad_pause_mode_as_vllm_does(pair):
    v, m = both(pair, "POST", "/pause", params={"mode": "bogus"})
    assert (v.status_code, v.json()["error"]["param"], v.json()["error"]["type"]) == (400, "query.mode", "Bad Request")
    assert (m.status_code, m.json()["error"]["param"], m.json()["error"]["type"]) == (400, "query.mode", "Bad Request")
