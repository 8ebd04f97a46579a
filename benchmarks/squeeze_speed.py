"""Speed of `order repeat ... squeeze`: `expand-orders` on the stdlib v-half, squeezed
and plain, over a sweep of D x N.

    python benchmarks/squeeze_speed.py            # the sweep, up to D = 64, N = 512
    python benchmarks/squeeze_speed.py --quick    # sizes up to 32 x 64

Each time is the best of 3 runs of `resolve-params` and `expand-orders` (the `.pipe` file
parsed once beforehand), in CPU seconds: the machine is shared, and wall time varies
more. "plain" is the same file with `squeeze` taken out; the squeeze's own cost is the
difference. us/op is the squeezed time per compute op (flat = linear time).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from pipelang.api import load_file
from pipelang.ast import File
from pipelang.compiler import Options, run_passes
from pipelang.parser import stdlib_dir

SIZES = [(8, 64), (16, 64), (16, 256), (32, 64), (32, 128), (32, 256), (32, 512), (64, 512)]


def cpu_time(file: File, d: int, n: int, repeat: int = 3) -> float:
    """Best CPU time of the passes up to `expand-orders` on `file` at D = d, N = n."""
    options = Options({"D": str(d), "N": str(n)})
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run_passes(file, options, "expand-orders")
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 32 x 64 only")
    args = parser.parse_args()
    text = (stdlib_dir() / "v-half.pipe").read_text()
    assert text.count(" squeeze {") == 1
    with tempfile.TemporaryDirectory() as tmp:
        plain_path = Path(tmp) / "v-half-plain.pipe"
        plain_path.write_text(text.replace(" squeeze {", " {"))
        plain = load_file(str(plain_path))
    squeezed = load_file("v-half")
    sizes = SIZES[:4] if args.quick else SIZES
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| D | N | ops | plain s | squeeze s | squeeze us/op |")
    print("|---|---|---|---|---|---|")
    for d, n in sizes:
        ops = 2 * d * n * 3  # 2D stages, N micro-batches, F, B and W
        ours = cpu_time(squeezed, d, n)
        print(
            f"| {d} | {n} | {ops} | {cpu_time(plain, d, n):.3f} | {ours:.3f} | "
            f"{ours / ops * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
