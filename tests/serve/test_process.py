"""The server as a process: SIGTERM drains the stream in flight and exits 0; the CLI
refuses what it cannot do with a typed one-line error."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from .serve_helpers import WAIT_S, wait_for

HERE = Path(__file__).parent


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=WAIT_S).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_the_stream_in_flight_then_exits_zero(tiny_self_engines, reference):
    proc = subprocess.Popen([sys.executable, str(HERE / "slow_server.py"), str(tiny_self_engines)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"on (http://\S+)/v1", proc.stdout.readline()).group(1)
        body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "stream": True}
        text, events = "", []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                if len(events) == 2:
                    # two pieces in; the server holds the rest of the stream until the line below
                    proc.send_signal(signal.SIGTERM)
                    wait_for(lambda: _refused(url), "the server to stop listening")
                    proc.stdin.write("go on\n")
                    proc.stdin.flush()
        assert events[-1] == "data: [DONE]"
        assert len(events) > 3, "no piece came after SIGTERM: the stream was over, not drained"
        assert text == reference.generate("Once upon a time", max_new_tokens=30).text
        assert proc.wait(WAIT_S) == 0
        out = proc.stdout.read()
        assert "stopped (in-flight requests drained)" in out
    finally:
        proc.kill()
        proc.wait()


def test_cli_serve_on_a_busy_port_says_what_to_do(tiny_self_engines):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", str(tiny_self_engines), "--port", str(port)],
                           capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 2
    assert "ServeConfigError" in r.stderr and "--port" in r.stderr and "Traceback" not in r.stderr


def test_cli_serve_refuses_bad_settings_before_loading(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", str(tmp_path), "--workers", "0"],
                       capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 2 and "--workers 0" in r.stderr and "Traceback" not in r.stderr


def test_cli_serve_takes_the_key_from_the_environment_and_the_host_and_cors_flags(tiny_self_engines):
    import os
    env = dict(os.environ, SPECRT_API_KEY="env-key")
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", str(tiny_self_engines), "--port", "0",
                             "--allowed-hosts", "api.example, *.corp.example", "--cors-origin", "http://a.example",
                             "--max-body-bytes", "2048"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        banner = proc.stdout.readline()
        assert "API key required" in banner and "env-key" not in banner
        url = re.search(r"on (http://\S+)/v1", banner).group(1)
        key = {"authorization": "Bearer env-key"}
        assert httpx.get(url + "/v1/models", timeout=WAIT_S).status_code == 401
        r = httpx.get(url + "/v1/models", headers=key | {"host": "x.corp.example", "origin": "http://a.example"},
                      timeout=WAIT_S)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
        assert httpx.get(url + "/v1/models", headers=key | {"host": "evil.example"}, timeout=WAIT_S).status_code == 400
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 3000}, headers=key, timeout=WAIT_S)
        assert r.status_code == 413
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
