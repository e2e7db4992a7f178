"""epdserve's CLIP image processor against HF transformers' PIL-backed CLIPImageProcessor.

For a few image sizes and two processor settings (CLIP 224, LLaVA-1.5 336) it reports, per image:
the time of each processor from RGB pixels to the pixel tensor (median of --repeats), the peak of
Python allocations while one image is processed (tracemalloc: numpy, torch and PIL buffers all go
through it or through their own allocators, so this is a lower bound), and the largest difference
between their pixel values (0 means bit-identical).

    .venv/bin/python benchmarks/image_processor_bench.py --repeats 20
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np
import torch

from epdserve.shared.image_processor import ImageProcessor, ImageProcessorConfig

try:  # transformers >= 5 names the PIL-backed processor apart from the torchvision one
    from transformers import CLIPImageProcessorPil as HFProcessor
except ImportError:  # transformers 4: the plain class is the PIL one
    from transformers import CLIPImageProcessor as HFProcessor

SETTINGS = {
    "clip-224": {},
    "llava-1.5-336": {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},
}
SIZES = [(224, 224), (480, 640), (1080, 1920)]  # (height, width)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call imports and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the encoder's default is one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, raw in SETTINGS.items():
        ours = ImageProcessor(ImageProcessorConfig.from_dict(raw))
        hf = HFProcessor(**raw)
        for height, width in SIZES:
            rgb = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
            run_ours = lambda: ours.preprocess(rgb)  # noqa: E731
            run_hf = lambda: hf(images=rgb, return_tensors="pt")["pixel_values"][0]  # noqa: E731
            row = {
                "settings": name, "image": f"{width}x{height}",
                "ours_ms": 1000 * _median_seconds(run_ours, args.repeats),
                "hf_ms": 1000 * _median_seconds(run_hf, args.repeats),
                "ours_peak_mib": _peak_bytes(run_ours) / 2**20,
                "hf_peak_mib": _peak_bytes(run_hf) / 2**20,
                "max_abs_diff": float((run_ours() - run_hf()).abs().max()),
            }
            rows.append(row)
            print(f"{name:>14} {row['image']:>10}: ours {row['ours_ms']:7.2f} ms, HF {row['hf_ms']:7.2f} ms "
                  f"({row['hf_ms'] / row['ours_ms']:.1f}x); peak ours {row['ours_peak_mib']:6.1f} MiB, "
                  f"HF {row['hf_peak_mib']:6.1f} MiB; max |diff| {row['max_abs_diff']:g}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
