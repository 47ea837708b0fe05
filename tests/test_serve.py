"""`s2moe serve` on 127.0.0.1 with the embedded default model, driven by the official `openai`
client: completions and streamed chat, greedy output equal to `s2moe run --temperature 0`, arrival
order under concurrency, a client disconnect freeing the decoder, 400s with OpenAI error bodies.

The server runs lossless (--no-rg), so its greedy text is AR's whatever the draft lengths.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import openai  # the dev extra's: the official client is the reference for the wire format

from s2moe.runtime.serve.chat import ChatTemplate, load_chat_template
from s2moe.runtime.serve.worker import StopText

PROMPT = "def add(a, b):"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "s2moe.runtime.cli", "serve", "--port", str(port), "--no-rg"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _get(base + "/health")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"s2moe serve did not start: {proc.stderr.read()[-2000:]}")
            time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["default-moe"]
    assert _get(server + "/health")["status"] == "ok"


def test_greedy_completion_equals_run(client):
    r = client.completions.create(model="default-moe", prompt=PROMPT, max_tokens=24, temperature=0)
    ran = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-p", PROMPT, "-n", "24", "-t", "0",
                          "--method", "ar", "--json"], capture_output=True, text=True, timeout=300, check=True)
    expected = json.loads(ran.stdout)
    assert r.choices[0].text == expected["text"]
    assert r.usage.prompt_tokens == len(expected["prompt_tokens"])
    assert r.usage.completion_tokens == len(expected["tokens"])
    stats = r.model_extra["s2moe"]
    assert stats["method"] == "s2moe" and stats["expert_hits"] > 0 and stats["bytes_fetched"] >= 0


def test_streamed_chat_completion(client):
    stream = client.chat.completions.create(model="default-moe", messages=[{"role": "user", "content": "import os"}],
                                            max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens <= 10
    whole = client.chat.completions.create(model="default-moe", messages=[{"role": "user", "content": "import os"}],
                                           max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content and text  # streaming and not: the same greedy text


def test_a_requests_seed_makes_sampling_reproducible(client):
    def sampled(seed):
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sampled(0) == sampled(0) and sampled(5) == sampled(5)
    assert len({sampled(s) for s in range(4)}) >= 3  # the seed is used, not ignored
    # and it is AR's text for that seed (the coupled sampler), whatever this server's AE drafted
    ran = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-p", PROMPT, "-n", "12", "-t", "1",
                          "--seed", "5", "--method", "ar", "--json"], capture_output=True, text=True, timeout=300,
                         check=True)
    assert sampled(5) == json.loads(ran.stdout)["text"]


def test_stop_sequence_cuts_the_text(client):
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[5:9]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_two_concurrent_requests_finish_in_arrival_order(client, server):
    results: dict[str, object] = {}

    def ask(key, n):
        results[key] = client.completions.create(model="m", prompt=PROMPT, max_tokens=n, temperature=0)

    first = threading.Thread(target=ask, args=("first", 48))
    second = threading.Thread(target=ask, args=("second", 4))
    first.start()
    # the first is decoding when the second arrives: wait until the worker says so (a fixed sleep
    # let the second overtake when a loaded machine was slow to start the first)
    deadline = time.monotonic() + 60
    while not _get(server + "/health")["busy"]:
        assert time.monotonic() < deadline and first.is_alive(), "the first request never started decoding"
        time.sleep(0.01)
    second.start()
    first.join(120)
    second.join(120)
    a, b = results["first"].model_extra["s2moe"], results["second"].model_extra["s2moe"]
    assert results["first"].usage.completion_tokens == 48 and results["second"].usage.completion_tokens == 4
    assert b["seq"] == a["seq"] + 1  # served in arrival order, one at a time
    assert b["started_s"] >= a["finished_s"] and b["queued_ms"] > 0  # the second waited for the first


def test_client_disconnect_frees_the_decoder(client, server):
    before = _get(server + "/health")
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=1500, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 30
    while True:
        health = _get(server + "/health")
        if health["cancelled"] > before["cancelled"] and not health["busy"]:
            break
        assert time.monotonic() < deadline, f"the decoder was not freed: {health}"
        time.sleep(0.1)
    assert health["last"]["finish_reason"] == "cancelled" and health["last"]["tokens"] < 1500
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4  # the next request is served


@pytest.mark.parametrize("body, field", [
    (b'{"prompt": "x", "max_tokens": 4', None),  # not JSON
    (b'{"prompt": "x", "max_tokens": 4, "frequency_pennalty": 1}', "frequency_pennalty"),  # unknown field
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"max_tokens": 4}', "prompt"),
])
def test_bad_requests_get_400_with_an_error_body(server, body, field):
    status, reply = _post(server + "/v1/completions", body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    if field:
        assert field in reply["error"]["message"]


@pytest.mark.parametrize("flags, message", [
    (["--ae-lookahead", "0"], "--ae-lookahead 0: must be >= 1"),
    (["--acceptance", "bogus"], "--acceptance 'bogus': choose learned or confidence"),
    (["--draft-vocab", "99999"], "--draft-vocab 99999: choose 1..6144"),
])
def test_speculative_flags_reach_the_servers_settings(flags, message):
    """serve takes run's AE and draft-head flags; each is checked with the other settings (so a flag
    dropped on the way would pass), in one line, before the server listens. The port is held busy,
    so a server that ignored the flag fails fast at bind instead of serving until the timeout."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "serve", "--port", str(busy.getsockname()[1]),
                            *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr.strip().splitlines()[-1]


def test_bad_chat_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert info.value.status_code == 400


def test_prompt_longer_than_the_context_is_refused(server):
    status, reply = _post(server + "/v1/completions", json.dumps({"prompt": "x = 1\n" * 2000, "max_tokens": 4}).encode())
    assert status == 400 and "context" in reply["error"]["message"]


class _Chars:
    """A tokenizer whose tokens are characters (ids = code points)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_stop_text_holds_back_a_possible_stop_and_cuts_a_full_one():
    s = StopText(_Chars(), ("END",))
    out = "".join(s.push(ord(c)) for c in "abcEN")
    assert out == "abc" and not s.stopped  # "EN" might begin "END": held back
    out += s.push(ord("X"))
    assert out == "abcENX"
    out += "".join(s.push(ord(c)) for c in "yEND")
    assert out == "abcENXy" and s.stopped and s.text == "abcENXy"
    s = StopText(_Chars(), ("END",))
    assert "".join(s.push(ord(c)) for c in "tail E") + s.finish() == "tail E"  # released at the end


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}], "eos_token": "<|im_end|>"}))
    t = load_chat_template(str(tmp_path))
    assert t.name == "model" and t.eos == "<|im_end|>"
    assert t.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "base").mkdir()
    assert load_chat_template(str(tmp_path / "base")).render([{"role": "user", "content": "hi"}]) == "hi\n"


def test_a_converted_gguf_carries_the_folders_chat_template(tmp_path):
    """convert writes tokenizer_config.json's template as tokenizer.chat_template, and a GGUF's own
    template is the one chat and serve use (as llama.cpp does), with its BOS / EOS strings."""
    import shutil

    from s2moe.runtime.model.formats.gguf_index import GGUFIndex
    from s2moe.runtime.cli.common import DEFAULT_MODEL

    folder = tmp_path / "hf"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "m.gguf"  # no tokenizer_config.json beside it: the file alone must carry it
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "convert", "--model", str(folder), "--out", str(out),
                        "--type", "F16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    index = GGUFIndex(str(out))
    assert index.metadata["tokenizer.chat_template"] == CHATML
    t = load_chat_template(str(out))
    assert t.name == "model" and "tokenizer.chat_template" in t.origin
    assert t.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tokens = index.array("tokenizer.ggml.tokens")
    assert t.eos == tokens[index.metadata["tokenizer.ggml.eos_token_id"]] and t.eos
    assert load_chat_template(str(out), override=None).source == CHATML
    plain = tmp_path / "plain.gguf"  # the folder without a template: the file has none either
    (folder / "tokenizer_config.json").unlink()
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "convert", "--model", str(folder), "--out", str(plain),
                        "--type", "F16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokenizer.chat_template" not in GGUFIndex(str(plain)).metadata
    assert load_chat_template(str(plain)).name == "plain"


def test_chat_template_is_sandboxed():
    from jinja2.exceptions import SecurityError

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        evil.render([{"role": "user", "content": "x"}])
