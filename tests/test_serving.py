"""serve.py's server, checked as a client sees it: a real uvicorn server on the loopback interface, a real HTTP
client (httpx). OpenRLHF's request gives the API's rewards; concurrent callers each get their own answers from
shared batches; every limit and bad request has its status and one JSON line; a token is enforced when set; the
entry point listens on loopback by default and a SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import uvicorn
from conftest import ROOT
from entry_points import run_entry_point, train_small_run

import rewarduq_exp as r
from rewarduq_exp.serving.app import make_app
from rewarduq_exp.serving.batcher import QueueFull, Rows, ScoreBatcher
from rewarduq_exp.serving.settings import ServeSettings


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    return train_small_run(tmp_path_factory.mktemp("serving"), shared_cache)


@pytest.fixture(scope="module")
def model(trained):
    return r.load_run(trained, device="cpu", progress=False, truncation=True)


class Running:
    """A uvicorn server in a thread of this process, on a free loopback port."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def serve(model, **settings):
    return Running(make_app(model, ServeSettings.of({"port": 0, **settings}), strip=("<|im_end|>",)))


PROMPTS = [f"Topic {i}: write a reply." for i in range(6)]
RESPONSES = ["blue sky", "green field and river", "the", "ocean waves " * 3, "red", "a very long answer " * 5]


def test_openrlhfs_request_gives_the_apis_rewards_with_bounds_and_u(model):
    expected = model.score(PROMPTS, RESPONSES)
    queries = [p + c + "<|im_end|>" for p, c in zip(PROMPTS, RESPONSES)]   # as OpenRLHF sends them
    with serve(model) as server:
        got = httpx.post(f"{server.url}/get_reward", json={"query": queries, "prompts": PROMPTS, "labels": [""] * 6})
        assert got.status_code == 200, got.text
        body = got.json()
        np.testing.assert_allclose(body["rewards"], expected.reward, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(body["lower"], expected.lower, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(body["upper"], expected.upper, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(body["uncertainty"], expected.uncertainty, rtol=1e-6, atol=1e-7)
        assert body["k"] is None
        conservative = httpx.post(f"{server.url}/get_reward",
                                  json={"query": queries, "prompts": PROMPTS, "k": 1}).json()
        np.testing.assert_allclose(conservative["rewards"], model.reward(PROMPTS, RESPONSES, "conservative", k=1),
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(conservative["reward"], expected.reward, rtol=1e-6, atol=1e-7)
        pairs = httpx.post(f"{server.url}/score", json={"prompts": PROMPTS, "completions": RESPONSES}).json()
        np.testing.assert_allclose(pairs["reward"], expected.reward, rtol=1e-6, atol=1e-7)
        chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                 for p, c in zip(PROMPTS, RESPONSES)]
        conversations = httpx.post(f"{server.url}/score", json={"conversations": chats}).json()
        np.testing.assert_allclose(conversations["reward"], expected.reward, rtol=1e-6, atol=1e-7)
        info = httpx.get(f"{server.url}/info").json()
        assert info["method"] == "EnsMLP" and info["recalibrated"] and info["settings"]["token"] is False
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_concurrent_callers_get_their_own_answers_from_shared_batches(model):
    texts = [[f"answer {c} {i} " + "word " * ((c * 7 + i) % 9) for i in range(8)] for c in range(32)]
    prompts = [[f"Topic {(c + i) % 5}: write a reply." for i in range(8)] for c in range(32)]
    expected = [model.score(p, t).reward.to_numpy() for p, t in zip(prompts, texts)]
    # a wait long enough that the 32 requests meet even on a busy machine
    with serve(model, max_batch=256, max_wait_ms=200) as server, httpx.Client() as client:
        def call(c):
            return client.post(f"{server.url}/score", json={"prompts": prompts[c], "completions": texts[c]}).json()

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(call, range(32)))
        batches = server.server.config.app.state.batcher.batches
    for c in range(32):
        np.testing.assert_allclose(answers[c]["reward"], expected[c], rtol=1e-6, atol=1e-7)
    assert batches < 32   # merged: fewer model calls than requests


BAD = [
    ("POST", "/get_reward", b"{not json", 400, "the body is not JSON"),
    ("POST", "/get_reward", json.dumps([1, 2]).encode(), 422, "the body must be a JSON object, not a list"),
    ("POST", "/get_reward", json.dumps({"query": ["a"]}).encode(), 422, "prompts is missing"),
    ("POST", "/get_reward", json.dumps({"query": ["ab", "c"], "prompts": ["a"]}).encode(), 422,
     "query has 2 entries but prompts 1"),
    ("POST", "/get_reward", json.dumps({"query": ["xb"], "prompts": ["a"]}).encode(), 422,
     "query[0] does not start with prompts[0]"),
    ("POST", "/get_reward", json.dumps({"query": "ab", "prompts": ["a"]}).encode(), 422, "query must be a list"),
    ("POST", "/score", json.dumps({"prompts": ["a"] * 9, "completions": ["b"] * 9}).encode(), 413,
     "the request holds 9 completions, more than serve.max_items=8"),
    ("POST", "/score", json.dumps({"prompts": ["a"], "completions": ["b" * 101]}).encode(), 413,
     "completions[0] has 101 characters, more than serve.max_chars=100"),
    ("POST", "/score", json.dumps({"prompts": ["a" * 50] * 8, "completions": ["b" * 90] * 8}).encode(), 413,
     "more than serve.max_body_bytes=1000"),
    ("POST", "/score", json.dumps({"prompts": [], "completions": []}).encode(), 422, "holds no completion"),
    ("POST", "/score", json.dumps({"prompts": ["a"], "completions": ["b"], "k": -1}).encode(), 422,
     "k=-1 is invalid: must be a number >= 0"),
    ("POST", "/score", json.dumps({"prompts": ["a"], "completions": [[{"role": "x"}]]}).encode(), 422,
     "completions[0][0] must be a message"),
    ("POST", "/score", json.dumps({"conversations": [[{"role": "user", "content": "a"}]]}).encode(), 422,
     "conversations[0] must be a list of messages ending with the assistant's completion"),
    ("GET", "/get_reward", b"", 405, "GET /get_reward is not allowed"),
    ("POST", "/nowhere", b"{}", 404, "no route /nowhere"),
]


@pytest.mark.parametrize("method, path, body, status, message", BAD, ids=[f"{b[3]} {b[4][:30]}" for b in BAD])
def test_every_bad_request_gets_its_status_and_one_line(model, method, path, body, status, message):
    with serve(model, max_items=8, max_chars=100, max_body_bytes=1000) as server:
        got = httpx.request(method, f"{server.url}{path}", content=body)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert message in error and "\n" not in error and "Traceback" not in got.text


def test_a_token_is_required_when_set(model):
    with serve(model, token="s3cret") as server:
        request = {"prompts": ["a"], "completions": ["b"]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            got = httpx.post(f"{server.url}/score", json=request, headers=headers)
            assert got.status_code == 401 and "bearer token" in got.json()["error"]
        assert httpx.get(f"{server.url}/info").status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200   # a load balancer's probe needs no token
        ok = httpx.post(f"{server.url}/score", json=request, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()["rewards"]) == 1
        assert httpx.get(f"{server.url}/info", headers={"Authorization": "Bearer s3cret"}).json()["settings"][
            "token"] is True


def test_a_slow_body_gets_408(model):
    with serve(model, body_timeout_s=0.5) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompts\"")
            reply = b""
            while b"}" not in reply:   # until the JSON body of the answer has arrived
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "body_timeout_s=0.5" in reply


def test_a_full_queue_refuses_at_once_and_memory_stays_bounded():
    """The queue holds at most max_queue completions: one more request is refused (503 at the route), not queued."""
    release = threading.Event()

    def slow(parts):
        release.wait(10)
        n = sum(len(part) for part in parts)
        return np.zeros(n), np.ones(n)

    async def scenario():
        batcher = ScoreBatcher(slow, max_batch=4, max_wait_s=0, max_queue=8)
        batcher.start()
        first = asyncio.ensure_future(batcher.score(["p"] * 4, ["c"] * 4))   # being scored (blocked)
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(batcher.score(["p"] * 8, ["c"] * 8))  # fills the queue
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match=r"8 completions are waiting to be scored \(serve.max_queue=8\)"):
            await batcher.score(["p"], ["c"])
        release.set()
        results = await asyncio.gather(first, waiting)
        await batcher.stop()
        return results, batcher

    (first, waiting), batcher = asyncio.run(scenario())
    assert len(first[0]) == 4 and len(waiting[0]) == 8 and batcher.queued == 0
    assert batcher.batches == 3   # the 8 waiting ones in two slices of max_batch=4


def test_a_full_batch_does_not_wait_out_the_bound():
    """The batch goes to the model once it is full, not after max_wait_s (here a minute)."""
    def instant(parts):
        n = sum(len(part) for part in parts)
        return np.zeros(n), np.ones(n)

    async def scenario():
        batcher = ScoreBatcher(instant, max_batch=4, max_wait_s=60, max_queue=8)
        batcher.start()
        reward, _ = await asyncio.wait_for(batcher.score(["p"] * 4, ["c"] * 4), 20)
        await batcher.stop()
        return reward

    assert len(asyncio.run(scenario())) == 4


def test_requests_that_arrive_together_are_prepared_in_one_call_and_a_refusal_stays_with_its_request():
    calls = []

    def prepare(prompts, completions):
        calls.append(len(prompts))
        if "bad" in completions:
            raise ValueError("bad text")
        return Rows(prompts, completions)

    batcher = ScoreBatcher(lambda parts: None, max_batch=8, max_wait_s=0, max_queue=64, prepare_fn=prepare)
    together = batcher._prepare_together([(["p"] * 2, ["a", "b"]), (["p"], ["c"])])
    assert calls == [3] and [r.completions for r in together] == [["a", "b"], ["c"]]
    calls.clear()
    mixed = batcher._prepare_together([(["p"], ["a"]), (["p"], ["bad"]), (["p"], ["c"])])
    assert calls == [3, 1, 1, 1] and isinstance(mixed[1], ValueError)
    assert mixed[0].completions == ["a"] and mixed[2].completions == ["c"]


def test_a_request_the_model_refuses_fails_alone(trained):
    """Requests are prepared (checked against the model's length) one by one as they arrive: an over-long text
    without truncation is refused with 422, and the request batched beside it is still scored."""
    strict = r.load_run(trained, device="cpu", progress=False, truncation=False)
    too_long = "word " * (strict.max_length + 10)
    with serve(strict, max_wait_ms=500) as server, httpx.Client() as client, ThreadPoolExecutor(2) as pool:
        def call(completion):
            return client.post(f"{server.url}/score", json={"prompts": ["Hi"], "completions": [completion]})

        bad, good = pool.map(call, [too_long, "a fine answer"])
    assert bad.status_code == 422 and f"max_length={strict.max_length}" in bad.json()["error"]
    assert good.status_code == 200
    np.testing.assert_allclose(good.json()["reward"], strict.score(["Hi"], ["a fine answer"]).reward, rtol=1e-6,
                               atol=1e-7)


def test_settings_are_checked_in_one_line():
    from rewarduq_exp.core.errors import UserError

    for values, message in (({"port": 70000}, "serve.port=70000 is too large: at most 65535"),
                            ({"k": -1}, "serve.k=-1 is invalid"),
                            ({"max_queue": 4, "max_items": 8}, "serve.max_queue=4 is invalid"),
                            ({"colour": 1}, "serve.colour is not a setting of serve.py")):
        with pytest.raises(UserError, match=message):
            ServeSettings.of(values)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on at ``port`` (the kernel's table, /proc/net/tcp)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_serve_py_listens_on_loopback_and_a_sigterm_drains_and_exits_0(trained, shared_cache, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), f"run={trained}", f"serve.port={port}",
                             "device=cpu", f"paths.cache_dir={shared_cache}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        info = httpx.get(f"http://127.0.0.1:{port}/info").json()
        assert info["settings"]["host"] == "127.0.0.1"
        assert listening_addresses(port) == {"127.0.0.1"}   # loopback only, not every interface
        with ThreadPoolExecutor(4) as pool:   # requests in flight when the signal comes are answered
            calls = [pool.submit(httpx.post, f"http://127.0.0.1:{port}/score",
                                 json={"prompts": ["a"] * 1000, "completions": [f"b {i}" for i in range(1000)]},
                                 timeout=120) for _ in range(4)]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:   # all four in the server (queued or scored) before the signal comes
                info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=30).json()
                if info["received"] >= 4000:
                    break
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            answers = [c.result() for c in calls]
        assert all(a.status_code == 200 and len(a.json()["rewards"]) == 1000 for a in answers)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in proc.stderr.read()


def test_serve_py_refuses_bad_settings_before_loading(tmp_path):
    for args, message in ((["run=x", "serve.port=70000"], "serve.port=70000 is too large"),
                          (["serve.max_items=0"], "serve.max_items=0 is invalid")):
        proc = run_entry_point(ROOT / "serve.py", args, tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


GRPO_THROUGH_THE_SERVER = """
import sys
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from rewarduq_exp.serving.client import RemoteReward

policy, url, out = sys.argv[1:4]
reward = RemoteReward(url, k=1.0)
data = Dataset.from_dict({"prompt": [f"Topic {i}: write a reply." for i in range(8)]})
args = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no",
                  disable_tqdm=True, use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0)
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tokenizer = AutoModelForCausalLM.from_pretrained(policy), AutoTokenizer.from_pretrained(policy)
trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=args, train_dataset=data)
trainer.train()
print("steps", trainer.state.global_step)
"""


@pytest.mark.e2e
def test_trls_grpo_in_another_process_trains_through_the_server(trained, shared_cache, tmp_path):
    """Two GRPO steps of the tiny policy, rewarded by RemoteReward through serve.py (r - u per completion)."""
    from omegaconf import OmegaConf

    from rewarduq_exp.data.registry import CONF_DIR
    from rewarduq_exp.models.backbone import Backbone

    policy = Backbone(OmegaConf.load(CONF_DIR / "model" / "tiny-qwen3.yaml"), cache_dir=shared_cache,
                      device="cpu").source
    port = _free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), f"run={trained}", f"serve.port={port}",
                               "device=cpu", f"paths.cache_dir={shared_cache}"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        (tmp_path / "grpo.py").write_text(GRPO_THROUGH_THE_SERVER)
        proc = subprocess.run([sys.executable, "grpo.py", str(policy), url, str(tmp_path / "trainer")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "steps 2" in proc.stdout
        assert httpx.get(f"{url}/info").json()["scored"] == 2 * 4   # two steps of 4 completions each
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
