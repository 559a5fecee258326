"""Each codec on model-like float32 data: bytes out / in, encode and decode speed, the error.

    python benchmarks/codecs.py                      # 1 MiB chunks, weights and gradients, 5 rounds
    python benchmarks/codecs.py --chunk 256K --rounds 9 --json out.json

Data: "weights" ~ N(0, 0.02) with one value in 97 a hundred times larger; "gradients" ~
N(0, 1e-4) with a heavier tail (Student t, 3 degrees of freedom) — the shapes the issue's
starting figures used.  One thread, chunk by chunk into reused buffers, as a lane would code
them; per codec and data set the median over rounds of encode and decode throughput (input
bytes per second), the coded size over the input size, the largest relative error among
normal values, and the break-even link: below that rate the coded transfer (encode, send the
coded bytes, decode, pipelined: the slowest of the three stages) beats sending raw bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from commd.bench.spec import parse_size  # noqa: E402
from commd.codecs import CODECS  # noqa: E402


def datasets(total: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(total // 4) * 0.02).astype(np.float32)
    weights[::97] *= 100
    gradients = (rng.standard_t(3, total // 4) * 1e-4).astype(np.float32)
    return {"weights": weights, "gradients": gradients}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", default="1M", help="bytes per coded chunk")
    parser.add_argument("--total", default="32M", help="bytes of each data set")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    chunk, total = parse_size(args.chunk), parse_size(args.total)
    if chunk <= 0 or chunk % 4 or total < chunk:
        parser.error("--chunk: a positive multiple of 4 bytes, at most --total")
    print(f"codecs on float32, {args.chunk} chunks, {args.total} per data set, one thread, median of "
          f"{args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    print(f"{'codec':<14} {'data':<10} {'out/in':>7} {'enc GB/s':>9} {'dec GB/s':>9} {'max rel err':>12} "
          f"{'break-even Gbit/s':>18}")
    rows = []
    for name, data in datasets(total).items():
        pieces = [data[i:i + chunk // 4] for i in range(0, data.size, chunk // 4)]
        for codec in CODECS:
            out = np.empty(codec.max_encoded(chunk), np.uint8)
            coded = [np.empty(codec.max_encoded(chunk), np.uint8) for _ in pieces]
            lengths = [0] * len(pieces)
            back = np.empty(chunk // 4, np.float32)
            enc, dec = [], []
            worst = 0.0
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for k, piece in enumerate(pieces):
                    lengths[k] = codec.encode(piece, coded[k])
                enc.append(data.nbytes / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for k, piece in enumerate(pieces):
                    codec.decode(coded[k][:lengths[k]], back[:piece.size])
                dec.append(data.nbytes / (time.perf_counter() - t0))
            for k, piece in enumerate(pieces):  # the error, outside the timing
                codec.decode(coded[k][:lengths[k]], back[:piece.size])
                normal = np.abs(piece) > 1.2e-38
                if normal.any():
                    rel = np.abs(back[:piece.size][normal].astype(np.float64) - piece[normal]) / np.abs(piece[normal])
                    worst = max(worst, float(rel.max()))
            del out
            ratio = sum(lengths) / data.nbytes
            e, d = statistics.median(enc), statistics.median(dec)
            # coded transfer time per input byte: max(1/e, ratio/link, 1/d) < 1/link  <=>  link < min(e, d)·(1 - ...)
            # pipelined stages: it wins while the link is slower than both codec stages and ratio < 1
            break_even = min(e, d) * 8 / 1e9 if ratio < 1 else 0.0
            rows.append({"codec": codec.name, "data": name, "ratio": ratio, "encode_GBps": e / 1e9,
                         "decode_GBps": d / 1e9, "max_rel_err": worst, "break_even_gbit": break_even})
            print(f"{codec.name:<14} {name:<10} {ratio:7.3f} {e / 1e9:9.2f} {d / 1e9:9.2f} {worst:12.2e} "
                  f"{break_even:18.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
