"""Where a conversion's CPU seconds go: one `kvcalib convert` under cProfile, on one thread.

    python benchmarks/profile_convert.py SOURCE [--recipe quarot-kv4] [--top 25]

convert reads and transforms on a producer thread and hashes on a third; cProfile sees only the
thread it runs in, so here both run inline on the main thread (`ahead` yields the producer's
items as they are made, the hasher's work runs at submit) and the profile's timer is the
process's CPU time: every CPU second of the conversion is in the first table (by own time); the
second lists kvcalib's functions and the import machinery by cumulative time (the phases).
The output goes to a temporary folder beside SOURCE and is deleted. Run it with the source's
sha256 cached (`kvcalib calibrate` of it, or bench_scale's primed cache) to profile convert*.
"""

import argparse
import contextlib
import cProfile
import pstats
import resource
import shutil
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import kvcalib


@contextlib.contextmanager
def _inline(items, depth):
    yield items


class _InlineHasher:
    """ThreadPoolExecutor's submit and shutdown, run at once on the caller's thread."""

    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait=True):
        pass


def _convert(source: Path, recipe: str, out: Path) -> None:
    """kvcalib.convert with its producer and hasher inline; its imports are profiled too, as
    the benchmark's convert task pays them."""
    import kvcalib.conversion.convert as conv

    class InlineWriter(conv.ShardWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._hasher.shutdown()
            self._hasher = _InlineHasher()

    conv.ahead, conv.ShardWriter = _inline, InlineWriter
    kvcalib.convert(source, recipe=recipe, output=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--recipe", default="quarot-kv4")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="profile-convert-", dir=args.source.parent)) / "out"
    profile = cProfile.Profile(time.process_time)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        profile.runcall(_convert, args.source, args.recipe, out)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"wall {time.perf_counter() - wall:.1f} s, CPU {time.process_time() - cpu:.1f} s "
        f"(profiler's overhead included), peak RSS {rss:.2f} GiB"
    )
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)  # where the seconds are spent
    stats.sort_stats("cumulative").print_stats(r"kvcalib|_bootstrap>", args.top)  # by phase


if __name__ == "__main__":
    main()
