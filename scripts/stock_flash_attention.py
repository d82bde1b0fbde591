"""Stock llama.cpp with and without flash attention on this machine: prefill and decode tokens/s after a
document of N tokens, alternating, through the same llama.cpp build the native engine links (its stock path,
full f16 KV). llama-cpp-python leaves flash attention off by default; llama.cpp's own tools turn it on.

    python scripts/stock_flash_attention.py --model gemma3-270m --context 8192 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics

from sekv_local.models.registry import resolve_model
from sekv_local.native.bindings import NativeModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=7700)
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded after the document")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = NativeModel(str(resolve_model(args.model, show_progress=False)), args.threads)
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name, flag in (("off", 0), ("on", 1)):
            runs[name].append(model.stock_bench(args.context, args.decode, flag))
    print(f"stock llama.cpp, {args.model}, {args.context} tokens, medians of {args.repeats}")
    for name, values in runs.items():
        prefill = statistics.median(v[0] for v in values)
        decode = statistics.median(v[1] for v in values)
        print(f"flash attention {name:>3}: prefill {prefill:7.1f} tok/s, decode {decode:6.1f} tok/s")


if __name__ == "__main__":
    main()
