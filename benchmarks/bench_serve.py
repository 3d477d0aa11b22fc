"""Serving through the HTTP API: decode tokens/s at 1, 4 and 16 concurrent streaming
requests and time to first token of a 512-token prompt, for a dummy Qwen3-30B-A3B-shaped
model behind `moeferry serve`, with decode CUDA graphs and with `--disable-cuda-graph`.

Each server runs as a subprocess on 127.0.0.1 (a free port) and is driven with httpx over
/v1/completions, token-id prompts, `stream: true`, ignore_eos, each concurrency greedy
(temperature 0) and sampled (temperature 1, the OpenAI API's default, seeded). Per request the
client records the arrival time of every streamed token and the exact token count from the
usage chunk. Decode tokens/s = sum over requests of (tokens - 1, those after its first token)
/ (last token anywhere - first "first token" anywhere); mean inter-token latency = the same
tokens' total time per request / their count. TTFT = request sent to first streamed token of
a lone request, median of 3 different prompts. A warm-up round runs before any timing.

The checkpoint directory holds config.json plus a synthetic word-level tokenizer over the
whole vocabulary (id i <-> "t<i>"): without a tokenizer the server streams no text, hence no
per-token events; with this one every token decodes to text, so each token is one SSE event.

With --attack, the table is instead the latency of well-behaved clients (each sending short
streaming completions one after another) alone, then beside attackers that each post one
kind of abusive body in a loop (a text prompt of millions of characters, a megabyte of
guided_choice, 60,000 messages) from a process of their own: p50 and p99 of time to first token
and of the whole request.

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks.common import (MODEL_ROUTING, add_results_flag, add_routing_flag, command_line, markdown_table,
                               report, routed_section, routing_note)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --allow-cpu: the same family at toy sizes, so the plumbing can be checked without a GPU.
_TINY_OVERRIDES = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "eos_token_id": 2047, "bos_token_id": 2046}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16], help="concurrent streaming requests")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0],
                   help="each concurrency is measured at each temperature (0: greedy)")
    p.add_argument("--ttft-prompt-len", type=int, default=512)
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--skip-no-graph", action="store_true", help="measure with CUDA graphs only")
    p.add_argument("--startup-timeout", type=float, default=420.0, help="seconds to wait for /health")
    add_routing_flag(p, default=MODEL_ROUTING)
    p.add_argument("--attack", nargs="+", choices=[*ATTACKS, "all"], default=None,
                   help="measure well-behaved clients' latency alone and beside each of these attackers instead")
    p.add_argument("--attack-clients", type=int, default=4, help="--attack: well-behaved clients")
    p.add_argument("--attack-seconds", type=float, default=30.0, help="--attack: seconds of each round")
    add_results_flag(p)
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the model directory -----------------------------------------------------------------------
def make_model_dir(args) -> tuple[str, dict]:
    # the layer count goes into config.json rather than --hf-overrides: the CLI hands that
    # flag's JSON through as a string (cli._flag_type reads dict[str, Any] as str)
    config = dict(QWEN3_30B_DIR_CONFIG, num_hidden_layers=args.layers)
    if args.allow_cpu and not torch.cuda.is_available():
        config.update(_TINY_OVERRIDES)
    path = write_config_dir(os.path.join(tempfile.mkdtemp(prefix="bench_serve_"), "qwen3-30b-a3b-dummy"), config)
    write_word_tokenizer(path, config["vocab_size"])
    return path, config


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer in which every id decodes to its own word, so each streamed token is text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


# ---- the server subprocess ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`moeferry serve` in a subprocess, its output in a log file. Invariant: once started,
    `stop()` (also on any exception inside the `with`) leaves no process behind."""

    def __init__(self, model_dir: str, args, graphs: bool):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = (["moeferry.cli", "serve"] if args.routing == MODEL_ROUTING else
                    ["benchmarks.serve_routed", args.routing, str(args.routing_seed)])
        self.cmd = [sys.executable, "-m", *launcher, "--model", model_dir, "--load-format", "dummy",
                    "--moe-strategy", "gpu", "--max-running-requests", str(max(args.requests)), "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-interval", "30"]
        if not graphs:
            self.cmd.append("--disable-cuda-graph")
        if not torch.cuda.is_available():
            self.cmd += ["--device", "cpu", "--num-tokens", "8192"]
        self.log_path = os.path.join(os.path.dirname(model_dir), f"server-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float) -> None:
        import httpx

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        print("starting:", " ".join(self.cmd), flush=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.perf_counter() - t0 < timeout:
                if self.proc.poll() is not None:
                    self._fail(f"the server exited with status {self.proc.returncode} before /health answered")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self.startup_s = time.perf_counter() - t0
                        print(f"server up in {self.startup_s:.1f} s", flush=True)
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        self._fail(f"/health did not answer within {timeout:.0f} s")

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"{why}; server log ({self.log_path}), last lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 30.0) -> None:
        """SIGINT (the server closes its streams and returns), then SIGKILL after `grace` s."""
        if self.proc is None or self.exit_code is not None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"server ignored SIGINT for {grace:.0f} s: killing it", flush=True)
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode


# ---- the client --------------------------------------------------------------------------------
@dataclass
class Stream:
    """What one streamed completion looked like from the client."""

    sent: float
    token_times: list[float]
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


async def stream_completion(client, prompt: list[int], max_tokens: int, temperature: float = 0.0) -> Stream:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": len(prompt),
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, times, used = time.perf_counter(), [], None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    if used is None or not times:
        raise RuntimeError(f"a stream ended without tokens or usage (tokens seen {len(times)}, usage {used})")
    return Stream(sent, times, used)


async def run_concurrent(url: str, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> list[Stream]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(600.0), limits=limits) as client:
        return await asyncio.gather(*(stream_completion(client, p, max_tokens, temperature) for p in prompts))


def decode_stats(streams: list[Stream]) -> tuple[float, float, float]:
    """(decode tokens/s, mean inter-token latency s, mean TTFT s) of one concurrent round."""
    tokens = sum(s.completion_tokens - 1 for s in streams)
    window = max(s.token_times[-1] for s in streams) - min(s.token_times[0] for s in streams)
    busy = sum(s.token_times[-1] - s.token_times[0] for s in streams)
    return tokens / window, busy / tokens, statistics.mean(s.ttft for s in streams)


# ---- well-behaved clients beside an attacker ---------------------------------------------------
def _huge_prompt() -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "t1 " * 2_500_000, "max_tokens": 1}


def _long_choice() -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "t1 t2", "max_tokens": 4, "guided_choice": ["t3 " * 330_000]}


def _many_messages() -> tuple[str, dict]:
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    return "/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": call}] * 60_000,
                                    "max_tokens": 2}


ATTACKS = {"prompt": _huge_prompt, "choice": _long_choice, "messages": _many_messages}
_ATTACKERS_PER_KIND = 6


# The attackers run in a process of their own, as they would on other machines: their uploads
# and JSON never share a GIL with the well-behaved clients' timing. One thread per connection,
# each posting its body again as soon as it is answered; the process prints the statuses.
_ATTACKER = """
import json, sys, threading, time, httpx
url, path, connections, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
body, statuses = sys.stdin.buffer.read(), []
deadline = time.monotonic() + seconds
def attack():
    with httpx.Client(base_url=url, trust_env=False, timeout=600, headers={"content-type": "application/json"}) as c:
        while time.monotonic() < deadline:
            statuses.append(c.post(path, content=body).status_code)
threads = [threading.Thread(target=attack) for _ in range(connections)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(statuses))
"""


def start_attackers(url: str, attack: str, seconds: float) -> subprocess.Popen:
    path, body = ATTACKS[attack]()
    proc = subprocess.Popen([sys.executable, "-c", _ATTACKER, url, path, str(_ATTACKERS_PER_KIND), str(seconds)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(json.dumps(body).encode())
    proc.stdin.close()
    return proc


async def _well_behaved(client, vocab: int, seed: int, max_tokens: int, until: float, out: list) -> None:
    i = 0
    while time.perf_counter() < until:
        stream = await stream_completion(client, random_prompt(seed * 100_000 + i, 32, vocab), max_tokens)
        out.append((stream.ttft, stream.token_times[-1] - stream.sent))
        i += 1


async def fairness_round(url: str, args, vocab: int, attack: str | None) -> tuple[list, list]:
    """(ttft, latency) of every well-behaved request and the attackers' statuses of one round."""
    import httpx

    limits = httpx.Limits(max_connections=args.attack_clients + 4)
    attackers = start_attackers(url, attack, args.attack_seconds + 1.0) if attack is not None else None
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(600.0), limits=limits) as client:
        if attackers is not None:
            await asyncio.sleep(1.0)  # the attackers are up and posting
        until = time.perf_counter() + args.attack_seconds
        samples: list = []
        await asyncio.gather(*(_well_behaved(client, vocab, c, 16, until, samples) for c in range(args.attack_clients)))
    statuses = []
    if attackers is not None:
        statuses = json.loads(attackers.stdout.read() or b"[]")
        attackers.wait(60)
    return samples, statuses


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_attacks(server: "ServerProcess", args, vocab: int) -> list[list]:
    asyncio.run(run_concurrent(server.url, [random_prompt(i, 32, vocab) for i in range(args.attack_clients)], 4))
    kinds = list(ATTACKS) if "all" in args.attack else args.attack
    rows = []
    for attack in [None, *kinds]:
        samples, statuses = asyncio.run(fairness_round(server.url, args, vocab, attack))
        ttfts, latencies = [t for t, _ in samples], [lat for _, lat in samples]
        answered = ", ".join(f"{n} x {code}" for code, n in sorted(
            {c: statuses.count(c) for c in statuses}.items())) or "-"
        rows.append([attack or "none", len(samples), f"{_quantile(ttfts, 0.5) * 1e3:.0f}",
                     f"{_quantile(ttfts, 0.99) * 1e3:.0f}", f"{_quantile(latencies, 0.5) * 1e3:.0f}",
                     f"{_quantile(latencies, 0.99) * 1e3:.0f}", answered])
        print(rows[-1], flush=True)
    return rows


def report_attacks(args, argv, server: "ServerProcess", rows: list[list]) -> None:
    table = markdown_table(["attacker (6 connections)", "well-behaved requests", "TTFT p50 ms", "TTFT p99 ms",
                            "latency p50 ms", "latency p99 ms", "attacker answers"], rows)
    where = ("CUDA graphs" if torch.cuda.is_available() else
             f"on the CPU, a tiny shape (hidden {_TINY_OVERRIDES['hidden_size']}, {_TINY_OVERRIDES['num_experts']} "
             f"experts, top-{_TINY_OVERRIDES['num_experts_per_tok']})")
    text = (f"{args.layers} layers, dummy weights, `--moe-strategy gpu`, {where}. {args.attack_clients} "
            f"well-behaved clients each stream 32-token completions of 16 tokens one after another for "
            f"{args.attack_seconds:g} s, alone and beside 6 connections posting one abusive body in a loop: prompt "
            f"(7.5 MB of text), choice (a 1 MB guided_choice string), messages (60,000 assistant messages with tool "
            f"calls), the attackers from a process of their own. Server up in {server.startup_s:.0f} s, exit status {server.exit_code} after SIGINT.")
    report("serve-attack", "Serving through the HTTP API: well-behaved clients beside an attacker",
           command_line("benchmarks.bench_serve", argv), table, text, args.results)


# ---- one server configuration ------------------------------------------------------------------
def measure(server: ServerProcess, args, vocab: int) -> tuple[list[list], list[float]]:
    """Decode rows for each concurrency, and the TTFT samples of the long prompt."""
    # warm-up: each measured batch size decodes and the long prompt prefills once before any
    # timing, so no Triton compile or first-use allocation lands in a measurement (eager mode
    # compiles per shape; graph mode captured its sizes at start)
    for n in args.requests:
        asyncio.run(run_concurrent(server.url, [random_prompt(10_000 * n + i, args.prompt_len, vocab)
                                                for i in range(n)], 4))
    asyncio.run(run_concurrent(server.url, [random_prompt(20_000, args.ttft_prompt_len, vocab)], 1))
    rows = []
    for n in args.requests:
        for temperature in args.temperatures:
            prompts = [random_prompt(1000 * n + i, args.prompt_len, vocab) for i in range(n)]
            streams = asyncio.run(run_concurrent(server.url, prompts, args.max_tokens, temperature))
            got = [s.completion_tokens for s in streams]
            if any(g != args.max_tokens for g in got):
                raise RuntimeError(f"asked {args.max_tokens} tokens per request, got {got}")
            rate, itl, ttft = decode_stats(streams)
            rows.append([n, f"{temperature:g}", f"{rate:.1f}", f"{rate / n:.1f}", f"{itl * 1e3:.2f}",
                         f"{ttft * 1e3:.1f}"])
            print(rows[-1], flush=True)
    ttfts = []
    for i in range(args.ttft_repeats):
        [s] = asyncio.run(run_concurrent(server.url, [random_prompt(30_000 + i, args.ttft_prompt_len, vocab)], 1))
        ttfts.append(s.ttft)
    print(f"TTFT {args.ttft_prompt_len}-token prompt: {[f'{t * 1e3:.1f} ms' for t in ttfts]}", flush=True)
    return rows, ttfts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench_serve: no CUDA GPU, nothing measured")
        return 0
    model_dir, config = make_model_dir(args)
    if args.attack:
        with ServerProcess(model_dir, args, graphs=True) as server:
            server.start(args.startup_timeout)
            try:
                rows = measure_attacks(server, args, config["vocab_size"])
            except Exception:
                print(f"server log, last lines:\n{server.log_tail()}", file=sys.stderr)
                raise
            server.stop()
        report_attacks(args, argv, server, rows)
        return 0
    decode_rows, ttft_rows, notes = [], [], []
    for graphs in [True] if args.skip_no_graph else [True, False]:
        label = "on" if graphs else "off"
        with ServerProcess(model_dir, args, graphs) as server:
            server.start(args.startup_timeout)
            try:
                rows, ttfts = measure(server, args, config["vocab_size"])
            except Exception:
                print(f"server log, last lines:\n{server.log_tail()}", file=sys.stderr)
                raise
            server.stop()
        decode_rows += [[label] + r for r in rows]
        ttft_rows.append([label, f"{statistics.median(ttfts) * 1e3:.1f}", f"{min(ttfts) * 1e3:.1f}",
                          f"{max(ttfts) * 1e3:.1f}"])
        notes.append(f"graphs {label}: server up in {server.startup_s:.0f} s, exit status {server.exit_code} "
                     f"after SIGINT")
    decode = markdown_table(["CUDA graphs", "concurrent requests", "temperature", "decode tok/s", "tok/s per request",
                             "mean inter-token ms", f"mean TTFT ms ({args.prompt_len}-token prompts)"], decode_rows)
    ttft = markdown_table(["CUDA graphs", f"TTFT ms, {args.ttft_prompt_len}-token prompt (median)", "min", "max"],
                          ttft_rows)
    shape = (f"{config['num_experts']} experts, top-{config['num_experts_per_tok']}, hidden {config['hidden_size']}"
             if args.allow_cpu and not torch.cuda.is_available() else "Qwen3-30B-A3B shape (128 experts, top-8)")
    text = (f"{args.layers} layers, {shape}, dummy weights, `--moe-strategy gpu`, max {max(args.requests)} running "
            f"requests. Streaming /v1/completions over HTTP on 127.0.0.1 (httpx): {args.prompt_len}-token random "
            f"prompts, {args.max_tokens} tokens each, ignore_eos, temperature 0 (greedy) or as shown (seeded, top_p 1). "
            f"{routing_note(args.routing, args.routing_seed)} Decode tok/s counts the tokens after each "
            f"request's first, over the time from the first first-token to the last token; TTFT is a lone request, "
            f"median of {args.ttft_repeats}, after a warm-up. " + "; ".join(notes) + ".")
    report(routed_section("serve", args.routing, MODEL_ROUTING), "Serving through the HTTP API", command_line("benchmarks.bench_serve", argv),
           decode + "\n\n" + ttft, text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
