"""How the decode kernel is launched: its (BLOCK_N, num_warps, num_stages), timed once per
kernel variant on a GPU (`choose`), and its split count from occupancy (`num_splits`,
`resident`). State per process: RESIDENT (programs per SM read off each compiled kernel) and
TUNED (each variant's timed choice); reloading the module forgets both."""

import functools

import torch
import triton

# (BLOCK_N, num_warps, num_stages): what `choose` times on a GPU, per (D, G, schemes, dtype)
CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2))
INTERPRETED = (32, 4, 1)
# what `choose` launches untuned (a CUDA graph captured before any eager step), by whether keys
# are pre-RoPE and whether a head has more than 64 channels, read on sm_90
# (benchmarks/kernel_budget; a test holds it to budget.json): of the candidates whose largest
# spill over the presets is smallest, the one with the fewest steady-loop warp-instructions per
# position for kvcalib-2. 64 positions on 4 warps, but pre-RoPE keys of 128 channels spill at 4
# and take 8 (at 64 channels 8 warps cost 2.6x the instructions of 4: each has too little of
# the tile; at 128, 128 positions on 8 would save a sixth of kvcalib-2's but spill kvcalib-4's
# and kvcalib-1.5's)
UNTUNED = {(False, False): (64, 4, 2), (True, False): (64, 4, 2),
           (False, True): (64, 4, 2), (True, True): (64, 8, 2)}  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(device: torch.device, programs: int, span: int, block_n: int,
               resident: int = 1) -> int:  # fmt: skip
    """Splits per (sequence, KV head): as many programs as the GPU runs at once, `resident` per
    SM (FlashInfer's scheduler: occupancy x SMs, no split when the programs fill it), each at
    least 4 blocks of the longest span a sequence can reach (fixed by capacity, not by
    lengths: a CUDA graph replays one grid)."""
    if device.type != "cuda":
        return 1
    wanted = max(1, resident * _sm_count(device) // max(programs, 1))
    return max(1, min(wanted, triton.cdiv(span, 4 * block_n)))


# shared memory an SM holds, by compute capability (CUDA's programming guide); others: the least
SHARED_PER_SM = {
    (8, 0): 164 * 1024,  # A100
    (8, 7): 164 * 1024,  # Jetson Orin
    (9, 0): 228 * 1024,  # H100, H200
    (10, 0): 228 * 1024,  # B200
    (10, 3): 228 * 1024,  # B300
}
SHARED_LEAST = 100 * 1024  # sm_86, sm_89, sm_120
RESERVED = 1024  # shared memory the system takes a program


def shared_per_sm(device: torch.device) -> int:
    """The shared memory an SM of `device` holds (bytes)."""
    return SHARED_PER_SM.get(torch.cuda.get_device_capability(device), SHARED_LEAST)


def resident(regs: int, warps: int, shared: int, shared_sm: int) -> int:
    """Programs an SM (64K registers, 64 warps, 32 programs, `shared_sm` bytes of shared
    memory: `shared_per_sm`) holds at once, of a kernel using regs registers per thread
    (allocated 8 at a time, per warp), `warps` warps and `shared` bytes (and the system's
    RESERVED a program)."""
    by_regs = 65536 // (triton.cdiv(max(regs, 1), 8) * 8 * 32 * warps)
    by_shared = shared_sm // (shared + RESERVED) if shared else 32
    return max(1, min(by_regs, 64 // warps, 32, by_shared))


RESIDENT: dict = {}  # (key, config): resident programs per SM, read off the compiled kernel


TUNED: dict = {}


def choose(key, device: torch.device, launch) -> tuple[int, int, int]:
    """The (BLOCK_N, num_warps, num_stages) of `key` (D, G, keys pre-RoPE, ...): timed once per
    key on a GPU (not while a CUDA graph is being captured: UNTUNED then, and the first eager
    step tunes), a fixed one interpreted."""
    if device.type != "cuda":
        return INTERPRETED
    if key in TUNED:
        return TUNED[key]
    if torch.cuda.is_current_stream_capturing():
        return UNTUNED[bool(key[2]), key[0] > 64]
    best = None
    for config in CONFIGS if key[0] <= 128 else [c for c in CONFIGS if c[0] <= 64]:
        launch(config)  # compile and warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            launch(config)
        end.record()
        end.synchronize()
        if best is None or start.elapsed_time(end) < best[0]:
            best = (start.elapsed_time(end), config)
    TUNED[key] = best[1]
    return best[1]
