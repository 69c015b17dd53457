"""The proxy in front of two real minigrpo servers, and the http engine through it, all on loopback.

    python -m pytest -q tests/test_proxy.py
"""
import http.server
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, call, file_digest, free_port, raw_authorization, save_random_adapter, start

from minigrpo.engine import SamplingParams
from minigrpo.protocol import already_loaded
from minigrpo.remote import HttpEngine, ServerError
from minigrpo.run import RunSettings, create_run
from minigrpo.storage import Storage

CLIENT, UPSTREAM = "client-key", "replica-token"
PROMPT = [2, 3, 11, 4, 5, 12]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Replica A (max_lora_rank 16), replica B (max_lora_rank 8), a proxy over both, a proxy over A and a dead port."""
    ports = [free_port() for _ in range(4)]
    procs = [start(["-m", "minigrpo.replica.serve", "--port", str(ports[i]), "--api_key", UPSTREAM, "--max_lora_rank", rank], ports[i], wait=False)
             for i, rank in ((0, "16"), (1, "8"))]
    replicas = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    dead = f"http://127.0.0.1:{free_port()}"
    common = ["--upstream_token", UPSTREAM, "--retry_s", "0.2", "--load_timeout_s", "15"]
    procs.append(start(["proxy.py", "--upstream", replicas[0], "--upstream", replicas[1], "--port", str(ports[2]),
                        "--api_key", CLIENT, *common], ports[2], wait=False))
    procs.append(start(["proxy.py", "--upstream", replicas[0], dead, "--port", str(ports[3]), "--no_auth", *common], ports[3], wait=False))
    deadline = time.time() + 120
    while call_ok(f"http://127.0.0.1:{ports[2]}/health") != 200 or call_ok(f"http://127.0.0.1:{ports[3]}/v1/models") != 200:
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the fleet did not come up"
        time.sleep(0.3)
    yield {"proxy": f"http://127.0.0.1:{ports[2]}", "half": f"http://127.0.0.1:{ports[3]}", "replicas": replicas,
           "dead": dead, "dir": tmp_path_factory.mktemp("adapters")}
    for p in procs:
        p.kill()


def call_ok(url):
    try:
        return call("GET", url)[0]
    except OSError:
        return None


def listed(fleet):
    """Adapter names each replica lists, asked directly."""
    return [{m["id"] for m in call("GET", r + "/v1/models", key=UPSTREAM)[2]["data"][1:]} for r in fleet["replicas"]]


def load(fleet, name, path):
    return call("POST", fleet["proxy"] + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, key=CLIENT)


def test_clients_need_the_proxy_key_and_replicas_never_see_it(fleet):
    assert call("GET", fleet["proxy"] + "/v1/models")[0] == 401
    assert call("GET", fleet["proxy"] + "/v1/models", key="wrong")[0] == 401
    assert call("GET", fleet["proxy"] + "/health")[0] == 200
    assert call("GET", fleet["proxy"] + "/v1/models", key=CLIENT)[0] == 200  # forwarded with the replica token
    assert call("GET", fleet["replicas"][0] + "/v1/models", key=CLIENT)[0] == 401


def test_load_reaches_every_replica(fleet):
    save_random_adapter(fleet["dir"] / "v1", r=2)
    status, text, _ = load(fleet, "v1", fleet["dir"] / "v1")
    assert status == 200 and text == "Success: LoRA adapter 'v1' added successfully."
    assert all("v1" in names for names in listed(fleet))


def test_a_load_that_fails_on_one_replica_is_on_none(fleet):
    save_random_adapter(fleet["dir"] / "r16", r=16, alpha=16)  # replica B serves rank <= 8 only
    status, text, _ = load(fleet, "r16", fleet["dir"] / "r16")
    assert status == 500 and "1/2 servers failed to load r16; rolled back" in text and fleet["replicas"][1] in text
    assert not any("r16" in names for names in listed(fleet))


def test_a_directory_that_appears_late_is_retried_until_it_loads(fleet):
    path, staged = fleet["dir"] / "late", fleet["dir"] / "late.staged"
    save_random_adapter(staged)  # then renamed whole: a replica never sees the config without the weights
    threading.Timer(1.0, staged.rename, args=(path,)).start()
    status, _, _ = load(fleet, "late", path)
    assert status == 200 and all("late" in names for names in listed(fleet))


def test_unload_answers_as_one_server_would(fleet):
    save_random_adapter(fleet["dir"] / "gone", r=2)
    load(fleet, "gone", fleet["dir"] / "gone")
    status, text, _ = call("POST", fleet["proxy"] + "/v1/unload_lora_adapter", {"lora_name": "gone"}, key=CLIENT)
    assert status == 200 and text == "Success: LoRA adapter 'gone' removed successfully."
    assert not any("gone" in names for names in listed(fleet))
    status, _, out = call("POST", fleet["proxy"] + "/v1/unload_lora_adapter", {"lora_name": "gone"}, key=CLIENT)
    assert status == 404 and out["error"]["message"] == "The lora adapter 'gone' cannot be found."


def test_completions_are_routed_and_name_their_replica(fleet):
    seen = set()
    for a in range(10, 16):  # new prompts: each is unmatched and goes to the next equally idle replica
        status, _, out = call("POST", fleet["proxy"] + "/v1/completions", {"prompt": f"{a}+{a}=", "n": 2, "max_tokens": 4},
                              key=CLIENT)
        assert status == 200 and len(out["choices"]) == 2
        seen.add(call.headers["X-Proxy-Upstream"])
    assert seen == {"0", "1"}


def test_pause_and_resume_reach_every_replica(fleet):
    assert call("POST", fleet["proxy"] + "/pause?mode=keep", key=CLIENT)[2] == {"status": "paused"}
    assert all(call("GET", r + "/is_paused", key=UPSTREAM)[2]["is_paused"] for r in fleet["replicas"])
    assert call("POST", fleet["proxy"] + "/resume", key=CLIENT)[2] == {"status": "resumed"}
    assert not any(call("GET", r + "/is_paused", key=UPSTREAM)[2]["is_paused"] for r in fleet["replicas"])


def test_a_dead_replica_is_named_and_completions_go_around_it(fleet):
    status, text, _ = call("GET", fleet["half"] + "/health")
    assert status == 502 and "1/2 servers unhealthy" in text and fleet["dead"] in text
    for _ in range(4):  # round-robin on ties would pick the dead one half the time
        assert call("POST", fleet["half"] + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200


def adapter_name(version: int) -> str:
    return f"policy-testrun-v{version:06d}"


def test_http_engine_loads_versions_generates_and_unloads_old_names(fleet):
    engine = HttpEngine(fleet["proxy"], CLIENT, keep=2)
    for v in range(4):
        save_random_adapter(fleet["dir"] / adapter_name(v), r=2, seed=v)
        engine.load_adapter(v, str(fleet["dir"] / adapter_name(v)))
    names = listed(fleet)
    assert all({adapter_name(2), adapter_name(3)} <= n and not {adapter_name(0), adapter_name(1)} & n for n in names)
    other = HttpEngine(fleet["proxy"], CLIENT, keep=2)  # a second generator: "already loaded" is success
    other.load_adapter(3, str(fleet["dir"] / adapter_name(3)))
    groups = engine.generate([PROMPT, PROMPT[:4]], SamplingParams(n=4, max_tokens=5))
    assert [len(g) for g in groups] == [4, 4]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 and c.finish_reason in ("stop", "length") for g in groups for c in g)
    for r in fleet["replicas"]:  # a replica restarted and forgot the adapter: the engine loads it again
        call("POST", r + "/v1/unload_lora_adapter", {"lora_name": adapter_name(3)}, key=UPSTREAM)
    assert len(engine.generate([PROMPT], SamplingParams(n=2, max_tokens=3))[0]) == 2
    engine.close()
    other.close()


def test_http_engine_fails_clearly_when_nothing_listens(fleet):
    engine = HttpEngine(fleet["dead"], retry_s=1)
    with pytest.raises(ServerError, match=fleet["dead"]):
        engine.load_adapter(0, os.fspath(fleet["dir"]))
    engine.close()


def test_http_engine_says_which_flag_sets_the_key_a_server_refused(fleet):
    for key in ("", "wrong"):  # no retry: the same key would be refused again
        engine = HttpEngine(fleet["proxy"], key, retry_s=60)
        with pytest.raises(ServerError, match="refused the key \\(401\\): pass --api_key KEY or MINIGRPO_API_KEY"):
            engine.load_adapter(0, os.fspath(fleet["dir"] / adapter_name(0)))
        engine.close()


def test_generate_without_the_key_exits_with_one_line_and_closes_its_session(fleet, tmp_path):
    storage = Storage(str(tmp_path / "run"))
    run_id = create_run(storage, RunSettings(), "exact match")["run_id"]
    storage.put("adapters/LATEST", f"policy-{run_id}-v000000\n")  # a version to load: the first request is refused
    env = {k: v for k, v in os.environ.items() if k != "MINIGRPO_API_KEY"}
    gen = subprocess.run([sys.executable, "generate.py", "--run_dir", str(tmp_path / "run"), "--engine", "http", "--url",
                          fleet["proxy"]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert gen.returncode == 1 and "refused the key (401): pass --api_key KEY or MINIGRPO_API_KEY" in gen.stderr
    assert "Traceback" not in gen.stderr and "Unclosed" not in gen.stderr, gen.stderr


def test_http_engine_waits_for_a_server_that_starts_late(tmp_path, capsys):
    """A generator started before its replica (vLLM takes minutes to start): the engine retries the refused
    connections, says so once, and loads the adapter when the server comes up."""
    class Loads(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Loads, bind_and_activate=False)
    threading.Timer(5.0, lambda: (server.server_bind(), server.server_activate(), server.serve_forever())).start()
    engine = HttpEngine(f"http://127.0.0.1:{port}", retry_s=60)
    try:
        t0 = time.monotonic()
        engine.load_adapter(0, str(tmp_path / "policy-late-v000000"))
        assert engine.version == 0 and time.monotonic() - t0 >= 4.5
        assert "retrying for up to 60s" in capsys.readouterr().out
    finally:
        engine.close()
        server.shutdown()


def roots(fleet, name):
    """The path each replica serves `name` from (None where it has no such name), asked directly."""
    return [next((m["root"] for m in call("GET", r + "/v1/models", key=UPSTREAM)[2]["data"] if m["id"] == name), None)
            for r in fleet["replicas"]]


def test_one_name_never_holds_two_sets_of_weights(fleet):
    p1, p2 = fleet["dir"] / "w1", fleet["dir"] / "w2"
    save_random_adapter(p1, seed=21)
    save_random_adapter(p2, seed=22)
    refused = (400, {"error": {"message": already_loaded("one"), "type": "InvalidUserInput", "param": None,
                               "code": 400}})
    assert load(fleet, "one", p1)[0] == 200
    assert load(fleet, "one", p2)[::2] == refused and roots(fleet, "one") == [str(p1)] * 2
    assert load(fleet, "one", p1)[0] == 400 and roots(fleet, "one") == [str(p1)] * 2  # same path: nothing changes
    # replica B got the name from elsewhere: a load through the proxy is refused and undone on replica A
    call("POST", fleet["replicas"][1] + "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(p2)},
         key=UPSTREAM)
    status, _, out = load(fleet, "two", p1)
    assert (status, out["error"]["message"]) == (400, already_loaded("two")) and roots(fleet, "two") == [None, str(p2)]


def test_the_proxy_answers_malformed_input_with_json_4xx(fleet):
    url = fleet["proxy"] + "/v1/completions"
    assert call("POST", url, raw=b"[" * 100_000, key=CLIENT)[::2] == (400, {"error": {
        "message": "the body nests too deeply to parse", "type": "BadRequestError", "param": None, "code": 400}})
    assert raw_authorization(url, b"Bearer \xff\xfe") == (401, {"error": "Unauthorized"})
    status, _, out = call("POST", url, raw=b'{"prompt": "\\udcff", "model": "\\udcff"}', key=CLIENT)  # a lone surrogate
    assert status == 404 and out["error"]["param"] == "model"
    status, _, out = call("POST", url, raw=b'{"prompt": [2, 3], "temperature": NaN}', key=CLIENT)
    assert status == 400 and out["error"]["param"] == "temperature"
    assert call("POST", fleet["proxy"] + "/v1/load_lora_adapter", raw=b'{"lora_name": "x", "lora_path": 1e999',
                key=CLIENT)[0] == 400
    status, text, _ = call("POST", fleet["proxy"] + "/v1/load_lora_adapter", key=CLIENT,
                           raw=b'{"lora_name": "\\udcff", "lora_path": "/nowhere"}')  # the replicas refuse the name
    assert status == 400 and "2/2 servers failed to load ?; rolled back" in text and "must be printable" in text


def test_http_engine_catches_a_replica_serving_other_weights_under_the_name(fleet):
    """Policy attribution: each Completion carries the digest of the weights that sampled it, which the trainer
    compares with the digest of the file the version names."""
    p1, p2 = fleet["dir"] / "policy-att-v000001", fleet["dir"] / "elsewhere"
    save_random_adapter(p1, seed=31)
    save_random_adapter(p2, seed=32)
    replica = fleet["replicas"][0]
    engine = HttpEngine(replica, UPSTREAM)
    engine.load_adapter(1, str(p1))
    digests = {c.adapter_digest for c in engine.generate([PROMPT], SamplingParams(n=2, max_tokens=3))[0]}
    assert digests == {file_digest(p1)}
    call("POST", replica + "/v1/load_lora_adapter", {"lora_name": p1.name, "lora_path": str(p2), "load_inplace": True},
         key=UPSTREAM)  # someone swaps the weights behind the name
    swapped = {c.adapter_digest for c in engine.generate([PROMPT], SamplingParams(n=2, max_tokens=3))[0]}
    assert swapped == {file_digest(p2)} != {file_digest(p1)}
    second = HttpEngine(replica, UPSTREAM)  # a second generator sees it at load time
    with pytest.raises(ServerError, match=f"already serves {p1.name} from {p2}, not from {p1}"):
        second.load_adapter(1, str(p1))
    engine.close()
    second.close()


def test_http_engine_refuses_another_base_model_and_requests_past_the_replicas_context(fleet, tmp_path):
    """vLLM loads an adapter made for another model and serves it (SmolLM2 took the demo's). The http engine
    compares the base model the server lists (its card without a parent) with the run's before any load; and vLLM
    cuts a completion short at max_model_len without a word, so the engine refuses a request that would not fit."""
    import shutil

    from minigrpo.model import DEMO_MODEL
    other = shutil.copytree(DEMO_MODEL, tmp_path / "other_model")  # the same weights in a folder of another name
    with pytest.raises(ServerError, match=f"serves {DEMO_MODEL}, but this run trains {other}, and its adapters fit"):
        HttpEngine(fleet["proxy"], CLIENT, retry_s=5, model=str(other))
    engine = HttpEngine(fleet["proxy"], CLIENT, retry_s=5, model=DEMO_MODEL + "/")  # the same folder: no complaint
    limit = call("GET", fleet["replicas"][0] + "/v1/models", key=UPSTREAM)[2]["data"][0]["max_model_len"]
    save_random_adapter(tmp_path / "policy-len-v000000", seed=7)
    engine.load_adapter(0, str(tmp_path / "policy-len-v000000"))
    assert len(engine.generate([PROMPT], SamplingParams(n=2, max_tokens=limit - len(PROMPT)))[0]) == 2
    with pytest.raises(ServerError, match=f"takes at most {limit} tokens \\(its max_model_len\\), fewer than a prompt "
                       f"of {len(PROMPT)} \\+ max_new_tokens {limit - len(PROMPT) + 1}: start the replicas with a larger"):
        engine.generate([PROMPT], SamplingParams(n=2, max_tokens=limit - len(PROMPT) + 1))  # vLLM would cut it short
    engine.close()


def test_card_of_finds_the_base_card_or_a_name_and_anything_else_is_no_card():
    from minigrpo.protocol import card_of
    models = b'{"data": [{"id": "base", "root": "/m", "parent": null, "max_model_len": 64}, ' \
             b'{"id": "a", "root": "/a", "parent": "base"}]}'
    assert card_of(models) == {"id": "base", "root": "/m", "parent": None, "max_model_len": 64}
    assert card_of(models, "a")["root"] == "/a" and card_of(models, "b") == {}
    for bad in (b'{"data": []}', b'{"data": [{"id": "a", "parent": "base"}]}', b"not json", b'{"data": 3}', b"[1]"):
        assert card_of(bad) == {}, bad


def test_the_proxy_reuses_no_connection_that_a_vllm_server_may_be_closing():
    """vLLM's server (uvicorn) closes a connection idle 5 s. A request the proxy sends on one as it closes fails, and
    the client gets a 502 (test_vllm.py's "nowhere" load met one). The proxy keeps a connection idle 4 s at most:
    reused after 0.5 s, a new one after 4.5 s (seen as the upstream's peer port)."""
    ports = []

    class Upstream(http.server.BaseHTTPRequestHandler):  # HTTP/1.1 with a length: it keeps the connection open
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            ports.append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server, port = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream), free_port()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = start(["proxy.py", "--upstream", f"http://127.0.0.1:{server.server_port}", "--port", str(port), "--no_auth"], port)
    try:
        for idle_s in (0, 0.5, 4.5):
            time.sleep(idle_s)
            assert call("GET", f"http://127.0.0.1:{port}/v1/models")[0] == 200
    finally:
        proxy.kill()
        server.shutdown()
    assert ports[-2] == ports[-3] and ports[-1] != ports[-2], ports
