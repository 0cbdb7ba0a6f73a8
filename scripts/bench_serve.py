"""Load-test serve.py's server on the loopback interface against in-process scoring of the same kind of texts.

    python scripts/bench_serve.py                  # 4096 completions at saturation, 10,000 requests for memory
    python scripts/bench_serve.py --smoke          # tiny sizes: a few seconds

The reward model is a run's, loaded as serve.py loads it (``load_run``: recalibrated, truncation on; ``--run``, or a
small ENS-MLP run trained here on the tiny offline backbone), once in the server process and once here, each with
its own in-memory feature store. The server runs in its own process (as
in use: its event loop and model never share this process's interpreter); the clients are asyncio tasks of this
process with one httpx connection each. Every text is scored once per measurement (fresh texts from the synthetic
world's generator), so no feature-cache hit flatters either side. Prints:

1. **Throughput at saturation**: 32 clients sending 8 completions per request, as fast as answers come, against one
   in-process ``RewardModel.score`` call on as many completions, measured in pairs one right after the other (this
   machine's speed drifts by +-15 % within minutes): the median ratio, its range and the geometric mean with its
   95 % paired t-interval over the pairs (goal: at least 0.8).
2. **Latency** p50 / p99 per request at 1, 8 and 32 concurrent clients (8 completions a request).
3. **Memory**: the server's resident memory (VmRSS) after a warm-up and after ``--requests`` more requests of 8
   completions drawn from a fixed pool (bounded feature store: the growth should be ~0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.downstream.statistics import paired_t_interval

ITEMS = 8   # completions per request (the "32 clients sending 8 items each")


def build_model(run: str, cache: str):
    """The run's reward model exactly as serve.py loads it (recalibrated, truncation on)."""
    from rewarduq_exp.api import load_run

    return load_run(run, device="cpu", truncation=True, cache_dir=cache, progress=False)


def train_run(folder: Path, cache: str, model: str = "tiny-qwen3") -> str:
    """A small ENS-MLP run on ``model`` (what ``--run`` defaults to): train.py as a user runs it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "train.py"), f"model={model}", "progress=false", "dataset.n_train=200",
                    "dataset.n_eval=50", "dataset.n_ood=50", "metric.diagrams=false", f"paths.cache_dir={cache}",
                    f"hydra.run.dir={folder}"], check=True, capture_output=True, cwd=folder.parent)
    return str(folder)


def texts(n: int, seed: int) -> tuple[list, list]:
    """``n`` fresh (prompt, completion) pairs of the synthetic world's generator (8-12 words each)."""
    world = SyntheticWorld(seed=seed)
    cand = world.candidates("eval", max(1, n // 8), 8, seed=seed)
    prompts = [p[0]["content"] for p, group in zip(cand.prompts, cand.texts) for _ in group]
    return prompts[:n], [t for group in cand.texts for t in group][:n]


def server_main(port: int, run: str, cache: str, ready, settings: dict) -> None:
    import uvicorn

    from rewarduq_exp.serving.app import make_app
    from rewarduq_exp.serving.settings import ServeSettings

    model = build_model(run, cache)
    model.score(["warm"], ["up"])
    app = make_app(model, ServeSettings.of({"port": port, **settings}))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    ready.set()
    server.run()


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def post(reader, writer, host: str, path: str, payload: dict) -> dict:
    """One HTTP/1.1 POST on a kept-alive connection, its JSON answer. A client of a few lines (the clients share the
    server's 2 cores here: httpx's pure-Python HTTP costs them more CPU than the server's scoring of 8 completions;
    an RL framework's clients run elsewhere)."""
    body = json.dumps(payload).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    answer = json.loads(await reader.readexactly(length))
    assert status == 200, answer
    return answer


async def run_clients(url: str, requests_per_client: list[list[tuple[list, list]]]) -> list[float]:
    """Each client sends its requests one after another on its own connection; every request's latency in s."""
    host, port = url.removeprefix("http://").split(":")
    latencies = []

    async def client(requests):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for prompts, completions in requests:
                start = time.perf_counter()
                await post(reader, writer, host, "/score", {"prompts": prompts, "completions": completions})
                latencies.append(time.perf_counter() - start)
        finally:
            writer.close()

    await asyncio.gather(*(client(r) for r in requests_per_client))
    return latencies


def split(prompts: list, completions: list, clients: int) -> list[list[tuple[list, list]]]:
    """Requests of ITEMS completions, dealt round-robin to ``clients`` clients."""
    reqs = [(prompts[i:i + ITEMS], completions[i:i + ITEMS]) for i in range(0, len(prompts), ITEMS)]
    return [reqs[c::clients] for c in range(clients)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=4096, help="scored at saturation, each way")
    parser.add_argument("--latency-requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--requests", type=int, default=10_000, help="requests of the memory check")
    parser.add_argument("--max-seconds", type=float, default=300, help="the memory check stops here at the latest")
    parser.add_argument("--run", default=None, help="a run folder to serve (default: a small ENS-MLP run trained "
                        "here on the tiny backbone)")
    parser.add_argument("--model", default="tiny-qwen3", help="the backbone of the run trained here without --run "
                        "(smollm2-135m: a real one, whose weights must be in --cache-dir or downloadable)")
    parser.add_argument("--cache-dir", default=None, help="where the backbone is built or found (default: a temporary "
                        "folder)")
    parser.add_argument("--repeats", type=int, default=7, help="pairs of saturation measurements (in-process, then "
                        "served; the median ratio is reported)")
    parser.add_argument("--max-batch", type=int, default=256, help="the server's serve.max_batch")
    parser.add_argument("--max-wait-ms", type=float, default=5, help="the server's serve.max_wait_ms")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds")
    args = parser.parse_args()
    if args.smoke:
        args.completions, args.latency_requests, args.requests, args.repeats = 64, 4, 40, 1

    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache_dir or temporary
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        run = args.run or train_run(Path(temporary) / "run", cache, args.model)
        settings = {"max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms}
        server = ctx.Process(target=server_main, args=(port, run, cache, ready, settings), daemon=True)
        server.start()
        model = build_model(run, cache)
        model.score(["warm"], ["up"])
        ready.wait(300)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):   # the model is built; the socket opens moments later
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(run_clients(url, split(*texts(ITEMS * 4, seed=99), 1)))   # the server's first requests
        try:
            n, ratios, rates, busy, per_call = args.completions, [], [], [], []
            for repeat in range(args.repeats):   # in pairs, one right after the other: both meet the same machine load
                prompts, completions = texts(n, seed=100 + 2 * repeat)
                start = time.perf_counter()
                model.score(prompts, completions)
                in_process = n / (time.perf_counter() - start)
                prompts, completions = texts(n, seed=101 + 2 * repeat)
                before = json.loads(urllib.request.urlopen(f"{url}/info").read())
                start = time.perf_counter()
                asyncio.run(run_clients(url, split(prompts, completions, 32)))
                wall = time.perf_counter() - start
                after = json.loads(urllib.request.urlopen(f"{url}/info").read())
                ratios.append(n / wall / in_process)
                rates.append((n / wall, in_process))
                busy.append((after["busy_s"] - before["busy_s"]) / wall)
                per_call.append((after["scored"] - before["scored"]) / max(1, after["batches"] - before["batches"]))
            middle = int(np.argsort(ratios)[len(ratios) // 2])
            # the pairs' log ratios: a paired t-interval, back on the ratio scale (a geometric mean)
            log_ratio = paired_t_interval(np.log(ratios))
            interval = ("" if len(ratios) < 2 else
                        f", geometric mean {np.exp(log_ratio.mean):.2f} [95 % CI {np.exp(log_ratio.lo):.2f}, "
                        f"{np.exp(log_ratio.hi):.2f}]")
            print(f"throughput at saturation ({n} completions, 32 clients x {ITEMS} per request, {args.repeats} "
                  f"pairs): served / in-process one call: median {ratios[middle]:.2f} (goal >= 0.8), range "
                  f"{min(ratios):.2f}-{max(ratios):.2f}{interval}; the median pair: served {rates[middle][0]:.0f}/s, "
                  f"in-process {rates[middle][1]:.0f}/s, {per_call[middle]:.0f} completions per model call, the model "
                  f"busy {busy[middle]:.0%} of the time")

            for level, clients in enumerate((1, 8, 32)):
                m = args.latency_requests * ITEMS * max(1, clients // 4)
                lat = np.array(asyncio.run(run_clients(url, split(*texts(m, seed=10 + level), clients)))) * 1000
                print(f"latency at {clients:2d} concurrent clients ({len(lat)} requests of {ITEMS}): "
                      f"p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")

            pool_prompts, pool_completions = texts(ITEMS * 64, seed=3)   # a fixed pool: memory, not compute
            pool = [(pool_prompts[i:i + ITEMS], pool_completions[i:i + ITEMS])
                    for i in range(0, len(pool_prompts), ITEMS)]
            asyncio.run(run_clients(url, [pool[c::8] for c in range(8)]))
            before = rss_mb(server.pid)
            sent, start = 0, time.perf_counter()
            while sent < args.requests and time.perf_counter() - start < args.max_seconds:
                block = [pool[(sent + i) % len(pool)] for i in range(min(512, args.requests - sent))]
                asyncio.run(run_clients(url, [block[c::16] for c in range(16)]))
                sent += len(block)
            after = rss_mb(server.pid)
            print(f"server memory: {before:.0f} MB after warm-up, {after:.0f} MB after {sent} more requests "
                  f"({time.perf_counter() - start:.0f} s); growth {after - before:+.1f} MB")
        finally:
            server.terminate()
            server.join(30)


if __name__ == "__main__":
    main()
