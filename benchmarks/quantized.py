"""Quantized serving on CPU: one stream's time per output token and the engine's memory, for a model's weights
as float32, as bfloat16, quantized to int8 at load and as its GGUF file ships them (packed, on the quantized
kernel), beside llama.cpp's llama-server on the same GGUF file and cores; and a roofline - the bytes a decoded
token reads, and that rate against this machine's memory bandwidth.

Forms of the model (each engine in a process of its own, --threads compute threads):

  float32    the converted folder's dequantized weights (the folder without its GGUF file)
  bfloat16   the same, in bfloat16
  int8       the same, its dense linear layers quantized at load, one scale per output channel (--quantization int8)
  gguf       the GGUF file as it ships (SmolLM2: Q4_1 layers and a Q8_0 embedding; Gemma 3 270M: Q4_K_M)
  llama-server  llama.cpp on the same GGUF file (benchmarks/setup_llamacpp.sh builds it), when present

TPOT: one prompt, --output-len tokens with EOS ignored, sampled at --temperature (1.0, the API's default; every
engine and llama-server alike, seeded), minus the time to the first token, per token after it;
median of --repeats runs (after one untimed warm-up). Memory: the process's resident set once the model is
loaded and warmed up. Bytes per token: what a batch-1 decode step reads of the weights (every linear layer's
packed weight, one embedding row; the KV cache at these lengths is <1% of it). Bandwidth: a STREAM-style read
(summing a 1 GiB float32 tensor on --threads threads), median of 5. Writes benchmarks/results/quantized.json
and .png; each engine's time a step by phase (the engine's step timer) goes into the JSON, --profile prints it.

    .venv/bin/python benchmarks/quantized.py                      # SmolLM2, 2 threads
    .venv/bin/python benchmarks/quantized.py --models smollm2,gemma3-270m --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stacks import llama_server_binary

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass his island at night."
FORMS = ("float32", "bfloat16", "int8", "gguf")


def measure_engine(folder: str, dtype: str, threads: int, output_len: int, repeats: int,
                   quantization: str | None = None, temperature: float = 1.0) -> dict:
    """In this process: load, warm up, then TPOT runs; memory and bytes per token."""
    import psutil
    import torch

    torch.set_num_threads(threads)
    from epdserve import LLM, SamplingParams
    from epdserve.shared.models.layers.linear import Linear

    llm = LLM(model=folder, dtype=dtype, num_kv_blocks=64, seed=0, quantization=quantization)
    first = SamplingParams(temperature=temperature, seed=0, max_tokens=1)
    full = SamplingParams(temperature=temperature, seed=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([PROMPT], full)
    timer = llm.engine.step_timer
    before, steps_before = timer.breakdown(), timer.num_steps
    tpots = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([PROMPT], first)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([PROMPT], full)
        tpots.append((time.perf_counter() - t - ttft) / (output_len - 1))
    steps = timer.num_steps - steps_before
    # Where a step's time goes (the first token's steps included: a prompt of a few tokens costs about a decode's).
    profile = {phase: 1e3 * (seconds - before[phase]) / steps for phase, seconds in timer.breakdown().items()}
    model = llm.engine.runner.model
    read = 0
    for m in model.modules():
        if isinstance(m, Linear):
            packed = m.quantized.panels if m.quantized is not None else m.panels if m.panels is not None else \
                m.packed_weight if m.packed_weight is not None else m.weight
            read += packed.numel() * packed.element_size()
    embed = model.model.embed_tokens  # one row a token: float, or a quantized row and its scales
    read += sum(t[0].numel() * t.element_size() for t in embed.buffers() if t is not None and t.dim() == 2) \
        if not hasattr(embed, "weight") else embed.weight.shape[1] * embed.weight.element_size()
    return {"tpot_ms": 1e3 * statistics.median(tpots), "tpot_ms_runs": [1e3 * t for t in tpots],
            "rss_mb": psutil.Process().memory_info().rss / 2**20, "bytes_per_token": read, "step_ms": profile}


def stream_read_gbps(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**28)  # 1 GiB of float32
    data.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t)
    return data.numel() * 4 / statistics.median(times) / 1e9


def run_form(folder: Path, form: str, args) -> dict:
    """One form in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        served = folder
        if form != "gguf":  # the folder without its GGUF file: the dequantized weights
            served = Path(tmp) / folder.name
            served.mkdir()
            for f in folder.iterdir():
                if f.name != "model.gguf":
                    (served / f.name).symlink_to(f)
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import quantized; "
                f"print(json.dumps(quantized.measure_engine({str(served)!r}, "
                f"{'bfloat16' if form == 'bfloat16' else 'float32'!r}, {args.threads}, {args.output_len}, "
                f"{args.repeats}, {'int8' if form == 'int8' else None!r}, {args.temperature})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama_server(binary: str, gguf: Path, args) -> dict:
    import httpx
    import psutil

    from epdserve.services.cli.launcher import free_port

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([binary, "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads), "-np", "1",
                             "-c", "2048", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} while starting")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        # Plain temperature sampling, as ours: llama-server's default top-k 40, top-p 0.95 and min-p 0.05 off.
        body = {"prompt": PROMPT, "n_predict": args.output_len, "ignore_eos": True, "temperature": args.temperature,
                "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0, "cache_prompt": False}
        httpx.post(url + "/completion", json=body, timeout=300)
        tpots = [httpx.post(url + "/completion", json=body, timeout=300).json()["timings"]["predicted_per_token_ms"]
                 for _ in range(args.repeats)]
        return {"tpot_ms": statistics.median(tpots), "tpot_ms_runs": tpots,
                "rss_mb": psutil.Process(proc.pid).memory_info().rss / 2**20, "bytes_per_token": None}
    finally:
        proc.terminate()
        proc.wait(30)


def model_folder(name: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from epdserve.services.cli.main import prepare_model

    return prepare_model(name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2", help="comma-separated: smollm2, gemma3-270m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of every engine and of llama-server (the API's default 1.0; 0: greedy)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated forms: " + ", ".join(FORMS))
    p.add_argument("--no-peer", action="store_true", help="leave llama-server out")
    p.add_argument("--profile", action="store_true", help="print where each form's steps spend their time")
    args = p.parse_args()
    bandwidth = stream_read_gbps(args.threads)
    print(f"memory read bandwidth ({args.threads} threads, STREAM-style sum): {bandwidth:.1f} GB/s")
    server = llama_server_binary()
    results = {"threads": args.threads, "output_len": args.output_len, "repeats": args.repeats,
               "temperature": args.temperature,
               "read_bandwidth_gbps": bandwidth, "models": {}}
    for name in args.models.split(","):
        folder = model_folder(name)
        cells = {form: run_form(folder, form, args) for form in args.forms.split(",")}
        if server and not args.no_peer:
            try:
                cells["llama-server"] = run_llama_server(server, (folder / "model.gguf").resolve(), args)
            except RuntimeError as exc:
                results.setdefault("peer_errors", []).append(f"{name}: {exc}")
                print(f"{name}: {exc}")
        results["models"][name] = cells
        base = cells.get("float32", next(iter(cells.values())))
        print(f"\n{name}: TPOT at batch 1, memory, roofline (vs: the float32 form, or the first measured)")
        print(f"{'form':13} {'TPOT ms':>8} {'vs f32':>7} {'RSS MB':>7} {'vs f32':>7} {'MB/token':>9} {'GB/s':>6} "
              f"{'of bw':>6}")
        for form, c in cells.items():
            gbps = c["bytes_per_token"] / c["tpot_ms"] / 1e6 if c["bytes_per_token"] else None
            c["achieved_gbps"] = gbps
            print(f"{form:13} {c['tpot_ms']:8.2f} {base['tpot_ms'] / c['tpot_ms']:6.2f}x {c['rss_mb']:7.0f} "
                  f"{c['rss_mb'] / base['rss_mb']:6.2f}x "
                  + (f"{c['bytes_per_token'] / 1e6:9.1f} {gbps:6.1f} {100 * gbps / bandwidth:5.0f}%" if gbps else ""))
        if args.profile:
            print("ms a step by phase (attention: KV writes and reads; forward: the rest of the model)")
            for form, c in cells.items():
                if "step_ms" in c:
                    print(f"{form:13} " + "  ".join(f"{k} {v:.2f}" for k, v in c["step_ms"].items() if v >= 0.005))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantized.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "quantized.png")
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for ax, (name, cells) in zip(axes[0], models.items()):
        ax.bar(list(cells), [c["tpot_ms"] for c in cells.values()], color="tab:blue")
        ax.set_title(f"{name}: TPOT at batch 1, {results['threads']} threads")
        ax.set_ylabel("ms per output token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
