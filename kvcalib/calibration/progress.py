"""Progress of a calibration: one bar per phase whose steps are weighted by their work, so that
its estimate of the time left holds from the first steps; the seconds of every phase.

    clock = Progress(enabled=True)
    with clock.phase("stats", total=work) as advance:
        ...
        advance(step_work)
    clock.timings        # {"stats": seconds, ...}

Work is counted in parameters run (a decoder layer's, the head's, times a backward's factor):
what one step costs on any device, up to a constant that the bar's rate absorbs.
"""

import contextlib
import sys
import time

from tqdm.auto import tqdm

BAR = "{desc:<12}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}"


class Progress:
    def __init__(self, enabled: bool = True, timings: dict | None = None):
        self.enabled = enabled
        self.timings = dict(timings or {})

    @contextlib.contextmanager
    def phase(self, name: str, total: float):
        """A bar named `name` over `total` work; yields advance(work). Records the seconds."""
        start = time.perf_counter()
        with tqdm(
            total=total, desc=name, file=sys.stderr, disable=not self.enabled, bar_format=BAR
        ) as bar:
            yield bar.update
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def note(self, line: str) -> None:
        """A line for the user before a phase (its predicted cost), when enabled."""
        if self.enabled:
            print(line, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def timed(self, name: str):
        """Records the seconds of a step too short for a bar."""
        start = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
