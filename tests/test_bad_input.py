"""Bad input to the server as a real process: each one gets a 4xx with vLLM's JSON error body naming the field,
while requests sent with it succeed and /health keeps answering at once. Then a random fuzz, slow and half-sent
requests, fairness between a large and a small request, and a failing batch retried one request at a time.

    python -m pytest -q tests/test_bad_input.py
"""
import asyncio
import json
import math
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import call, free_port, start

PROMPT = [2, 3, 11, 4, 5, 12]  # "12+34=" in the demo tokenizer (13 ids, max_model_len 64)
GOOD = {"prompt": PROMPT, "max_tokens": 4, "seed": 1, "logprobs": 0}
MSG = [{"role": "user", "content": "12+34="}]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start(["-m", "minigrpo.replica.serve", "--port", str(port), "--max_body_mb", "1", "--header_timeout_s", "1",
                  "--body_timeout_s", "1", "--max_batch_rows", "32"], port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()


def j(**fields) -> str:
    return json.dumps({"prompt": [2, 3]} | fields)


BAD = [  # (route, raw body, status, start of the message, param)
    ("completions", j(prompt=[]), 400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"),
    ("completions", j(prompt=[1, -2]), 400, "Token id -2 is out of vocabulary (size 13).", "prompt"),
    ("completions", j(prompt=[1, 999]), 400, "Token id 999 is out of vocabulary (size 13).", "prompt"),
    ("completions", j(prompt=[1, 2.0]), 400, "Either prompt or prompt_embeds", "prompt"),
    ("completions", j(prompt=[1] * 64), 400, "This model's maximum context length is 64 tokens. However, your "
                                             "request has 64 input tokens.", "prompt"),
    ("completions", j(prompt="1" * 100_000), 400, "This model's maximum context length is 64 tokens, and 100000 "
                                                  "characters", "prompt"),
    ("completions", j(prompt=""), 400, "The decoder prompt cannot be empty", "prompt"),
    ("completions", j(prompt=["12", "\u0000"]), 400, "The decoder prompt cannot be empty", "prompt"),
    ("completions", j(n=10**6), 400, "n must be an integer in [1, 256], got 1000000", "n"),
    ("completions", j(prompt=[PROMPT] * 40, n=256), 400, "40 prompts x n=256 is 10240 sequences", "prompt"),
    ("completions", j(temperature="hot"), 400, "temperature must be a finite number in [0, 10000.0], got 'hot'",
     "temperature"),
    ("completions", j(temperature=1e308), 400, "temperature must be a finite number in [0, 10000.0], got 1e+308",
     "temperature"),
    ("completions", j(repetition_penalty=1e308), 400, "repetition_penalty must be", "repetition_penalty"),
    ("completions", '{"prompt": [2], "temperature": NaN}', 400, "temperature must be a finite number", "temperature"),
    ("completions", '{"prompt": [2], "top_p": Infinity}', 400, "top_p must be a finite number in (0, 1]", "top_p"),
    ("completions", '{"prompt": [2], "top_p": 1e999}', 400, "top_p must be a finite number", "top_p"),
    ("completions", j(top_p=0), 400, "top_p must be a finite number in (0, 1], got 0", "top_p"),
    ("completions", j(logprobs=20), 400, "logprobs must be an integer in [0, 13], got 20", "logprobs"),
    ("completions", j(logprobs=-3), 400, "logprobs must be an integer in [0, 13], got -3", "logprobs"),
    ("completions", j(max_tokens=0), 400, "max_tokens must be an integer in [1, inf], got 0", "max_tokens"),
    ("completions", j(max_tokens=True), 400, "max_tokens must be an integer", "max_tokens"),
    ("completions", j(min_tokens=9, max_tokens=4), 400, "min_tokens must be an integer in [0, 4], got 9", "min_tokens"),
    ("completions", j(stop=5), 400, "stop must be a non-empty string or a list of them", "stop"),
    ("completions", j(stop=[""]), 400, "stop must be a non-empty string", "stop"),
    ("completions", j(stop_token_ids=[13]), 400, "stop_token_ids must be a list of token ids in [0, 13)",
     "stop_token_ids"),
    ("completions", j(logit_bias={"13": 1}), 400, "token_id(s) [13] in logit_bias contain out-of-vocab token ids. "
                                                  "Vocabulary size: 13", "logit_bias"),
    ("completions", '{"prompt": [2], "logit_bias": {"3": NaN}}', 400, "logit_bias must map token ids to finite",
     "logit_bias"),
    ("completions", j(logit_bias={"x": 1}), 400, "logit_bias must map token ids", "logit_bias"),
    ("completions", j(logit_bias={"\u00b2": 1}), 400, "logit_bias must map token ids", "logit_bias"),
    ("completions", j(logit_bias={"9" * 5000: 1}), 400, "logit_bias must map token ids", "logit_bias"),
    ("completions", j(logit_bias=0), 400, "logit_bias must map token ids", "logit_bias"),
    ("completions", j(stop=False), 400, "stop must be", "stop"),
    ("completions", j(presence_penalty=3), 400, "presence_penalty must be a finite number in [-2, 2]",
     "presence_penalty"),
    ("completions", j(frequency_penalty=-2.5), 400, "frequency_penalty must be", "frequency_penalty"),
    ("completions", j(repetition_penalty=0), 400, "repetition_penalty must be a finite number in (0, 10000.0]",
     "repetition_penalty"),
    ("completions", j(min_p=1.5), 400, "min_p must be a finite number in [0, 1]", "min_p"),
    ("completions", j(seed=2**64), 400, "seed must be an int64", "seed"),
    ("completions", j(ignore_eos="yes"), 400, "ignore_eos must be true or false", "ignore_eos"),
    ("completions", j(stream=True), 400, "stream=True is not supported by this server", "stream"),
    ("completions", j(echo=True), 400, "echo=True is not supported by this server", "echo"),
    ("completions", j(prompt_logprobs=1), 400, "prompt_logprobs=1 is not supported by this server", "prompt_logprobs"),
    ("completions", j(top_k=5), 400, "top_k=5 is not supported by this server", "top_k"),
    ("completions", j(best_of=2), 400, "best_of is not supported by this server", "best_of"),
    ("completions", j(model=["demo"]), 400, "model must be a string", "model"),
    ("completions", j(model="nope"), 404, "The model `nope` does not exist. Valid aliases: demo.", "model"),
    ("completions", "[" * 100_000, 400, "the body nests too deeply to parse", None),
    ("completions", '{"prompt": [2], "n": 1' + "0" * 5000 + "}", 400, "the body is not valid JSON", None),
    ("completions", b'{"prompt": "\xff"}', 400, "the body is not valid JSON", None),
    ("completions", '{"prompt": [2]', 400, "the body is not valid JSON", None),
    ("completions", '"a string"', 400, "the body must be a JSON object", None),
    ("completions", "x" * (2 * 2**20), 413, "Maximum request body size 1048576 exceeded.", None),
    ("chat/completions", json.dumps({"messages": []}), 400, "messages must be a non-empty list", "messages"),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "messages must be",
     "messages"),
    ("chat/completions", json.dumps({"messages": MSG, "echo": True}), 400, "echo is not supported", "echo"),
    ("chat/completions", json.dumps({"messages": MSG, "logprobs": True, "top_logprobs": 30}), 400,
     "top_logprobs must be an integer in [0, 13], got 30", "top_logprobs"),
    ("chat/completions", json.dumps({"messages": MSG, "top_logprobs": 2}), 400,
     "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
    ("chat/completions", json.dumps({"messages": MSG, "logprobs": 1.5}), 400, "logprobs must be true or false",
     "logprobs"),
]


@pytest.mark.parametrize("route, body, status, message, param", BAD, ids=[f"{b[0]}:{str(b[1])[:40]}" for b in BAD])
def test_bad_input_gets_a_json_error_naming_the_field_and_harms_no_one(server, route, body, status, message, param):
    with ThreadPoolExecutor(4) as pool:
        innocents = [pool.submit(call, "POST", server + "/v1/completions", GOOD) for _ in range(3)]
        got = call("POST", f"{server}/v1/{route}", raw=body if isinstance(body, bytes) else body.encode())
        t0 = time.time()
        health = call("GET", server + "/health")[0]
        health_s = time.time() - t0
        done = [f.result() for f in innocents]
    assert got[0] == status and got[2]["error"]["code"] == status and got[2]["error"]["param"] == param
    assert got[2]["error"]["message"].startswith(message)
    assert all(s == 200 and len(out["choices"]) == 1 for s, _, out in done)
    assert health == 200 and health_s < 1.0


def fuzz_body(rng: random.Random, route: str = "completions") -> str:
    """A valid request with one to three fields replaced by odd values, and sometimes a field nobody knows."""
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 4, "temperature": 0.8, "top_p": 0.9, "seed": 3, "logprobs": 1,
            "stop": ["9"], "stop_token_ids": [12], "min_tokens": 1, "logit_bias": {"3": 1.0}, "min_p": 0.05,
            "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1, "return_token_ids": True}
    if route == "chat/completions":
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": MSG, "logprobs": True, "top_logprobs": 1}
    odd = [None, True, False, 0, -1, 1, 2, 63, 64, 2**63, -2**70, 0.5, -0.5, 1e308, math.nan, math.inf, -math.inf, "",
           "1", "\x00", "\udcff", [], [0], [-1], [13], [[2, 3], []], [[2, 3], "12"], {}, {"99": 1}, {"1": math.nan},
           "9" * 300, [2] * 70, [{"role": "user"}], [{"role": "user", "content": "1" * 900}], [{"content": "1"}]]
    for key in rng.sample(sorted(body) + ["best_of", "prompt", "messages"], rng.randint(1, 3)):
        body[key] = rng.choice(odd)
    return json.dumps(body)


def test_fuzzed_requests_never_get_a_500_or_a_body_that_is_not_json(server):
    rng, statuses, health_s = random.Random(0), [], []
    with ThreadPoolExecutor(4) as pool:
        routes = ["completions", "chat/completions"] * 150
        answers = [pool.submit(call, "POST", f"{server}/v1/{r}", raw=fuzz_body(rng, r).encode()) for r in routes]
        while not all(a.done() for a in answers):
            t0 = time.time()
            assert call("GET", server + "/health")[0] == 200
            health_s.append(time.time() - t0)
        for a in answers:
            status, text, parsed = a.result()
            statuses.append(status)
            assert status in (200, 400, 404) and parsed is not None and "NaN" not in text, text[:300]
    assert statuses.count(400) > 100 and statuses.count(200) > 10  # the fuzz reaches both sides
    assert sorted(health_s)[int(0.99 * len(health_s))] < 0.5


def test_half_sent_requests_are_closed_after_the_header_timeout(server):
    port = int(server.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    assert call("GET", server + "/health")[0] == 200
    time.sleep(2.5)  # --header_timeout_s 1
    for s in socks:
        s.settimeout(1)
        assert s.recv(100) == b""  # closed by the server
        s.close()


def test_a_body_slower_than_the_body_timeout_gets_408(server):
    s = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\"")
    s.settimeout(10)
    head, _, body = s.recv(4096).decode().partition("\r\n\r\n")
    s.close()
    assert head.startswith("HTTP/1.1 408") and json.loads(body)["error"]["message"] == \
        "the request body did not arrive within 1s"


def test_a_body_its_content_encoding_cannot_decode_gets_400(server):
    r = requests.post(f"{server}/v1/completions", data=b"not gzip at all",
                      headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body cannot be read")


def test_a_large_request_does_not_starve_a_small_one(server):
    """16 prompts x n=16 with --max_batch_rows 32 take 8 rounds; a small request sent after it joins the next."""
    big = {"prompt": [PROMPT] * 16, "n": 16, "max_tokens": 40, "ignore_eos": True, "seed": 0}
    with ThreadPoolExecutor(2) as pool:
        t0 = time.time()
        large = pool.submit(lambda: (call("POST", server + "/v1/completions", big), time.time() - t0))
        time.sleep(0.1)
        small = pool.submit(lambda: (call("POST", server + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
                                     time.time() - t0))
        (large_answer, large_s), (small_answer, small_s) = large.result(), small.result()
    assert large_answer[0] == small_answer[0] == 200 and len(large_answer[2]["choices"]) == 256
    assert small_s < large_s / 2


def test_a_failing_batch_is_retried_one_request_at_a_time():
    """In-process: the scheduler and the engine, with a request no route would let through (a token id the
    embedding does not have): only that request gets the error."""
    from minigrpo.replica.serve import Server, ServeConfig
    from minigrpo.replica.sampling import ServerParams
    server = Server(ServeConfig())

    async def batch():
        worker = asyncio.create_task(server.scheduler.run())
        sp = ServerParams(n=2, max_tokens=3, seed=0)
        out = await asyncio.gather(*(server.scheduler.submit("demo", [p], sp) for p in ([2, 3], [2, 999], [4, 5])),
                                   return_exceptions=True)
        worker.cancel()
        return out

    good, bad, also_good = asyncio.run(batch())
    assert isinstance(bad, IndexError)
    assert [len(g[0]) for g in (good, also_good)] == [2, 2] and all(c.token_ids for c in good[0] + also_good[0])
