"""Helpers the tests share (tests/ is on pytest's path: `from support.tiny import tiny_model`).

    tiny          tiny random transformers models of every family, a character tokenizer,
                  a folder saved with its tokenizer (toolkit and integration tests)
    corpus        the bad-input corpus's cases, workspace and checks
    mutate        hypothesis strategies that damage JSON and safetensors files
    bodies        random quantized bodies of every layout (runtime tests)
    decode_cases  the decode kernel's cases and inputs, and its reference
    native_cases  stand-in compilers for the C library's build
    ptx           an executor of the kernels' inline PTX, one thread's instructions on CPU
    ptx_cta       an executor of a compiled kernel's whole PTX, every thread of a CTA, on CPU
                  tensors; `launches_executed` runs Triton launches through it
    ptx_runs      the kernels the tests execute that way, in a process without the interpreter
    floor_cases   benchmarks/kernel_floor.py's Gluon skeleton: its inputs and its reference
    calibrate     a tiny llama calibrated in memory (the calibration tests)
    caches        the simulated cache's tests' small llama, random ids and history reads

Each imports only what its tier has: bodies, decode_cases, mutate, native_cases, the ptx modules
and floor_cases run in the runtime-only venv (`make test-runtime`).
"""
