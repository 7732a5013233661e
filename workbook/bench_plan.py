"""Time labkit.plan's whole table for a Llama-style 7B model on 1 to 64 GPUs (issue 24's target: 30 s on 2 cores).

    python -m workbook.bench_plan [--model llama-7b] [--gpu a100-80gb] [--gpus 64] [--batch 64] [--depth fast]

Prints the seconds, the combinations and the fastest that fits; run by hand (not a timed test).
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> int:
    """Plan the model once in this process and print the wall and CPU seconds it took."""
    ap = argparse.ArgumentParser(prog="python -m workbook.bench_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b", help="a labkit.plan preset")
    ap.add_argument("--gpu", default="a100-80gb", help="a GPU of labkit.gpus.GPUS")
    ap.add_argument("--gpus", type=int, default=64, help="the most devices: every power of two up to it is planned")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=64, help="global batch: samples per optimizer step")
    ap.add_argument("--depth", default="fast", help="fast (the default of labkit.plan) or full")
    args = ap.parse_args(argv)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    from labkit.plan import format_plan, plan
    p = plan(args.model, args.gpu, args.gpus, args.seq_len, args.batch, depth=args.depth)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    print(format_plan(p))
    print(f"\n{args.model} on 1-{args.gpus} x {args.gpu}, depth {args.depth}: {len(p.rows)} combinations, "
          f"{p.fake_steps} run on fake tensors; {wall_s:.1f} s wall ({p.elapsed_s:.1f} s planning, the rest imports), "
          f"{cpu_s:.1f} s CPU, load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
