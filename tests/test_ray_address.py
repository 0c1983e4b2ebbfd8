"""An unreachable Ray address fails at once with a message naming it and what to check; Ctrl-C while
connecting ends the command at once, exit 130, one line, no traceback. (ray.init retried 127.0.0.1:1 or a
stale `auto` for more than ten minutes, and a Ctrl-C then took 10-27 s and printed a raw traceback.)

No Ray cluster is started: the addresses lead nowhere, or to a socket this test holds that never answers.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import ray
import ray._private.services as services

from cluster.cli import EXIT_FAILED, EXIT_INTERRUPTED
from cluster.cli import main as kvray_main
from tests.terminal_signals import sigint_as_in_a_terminal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "max_position_embeddings": 128,
}


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


@pytest.mark.parametrize("command", ["info", "run"])
def test_an_unreachable_address_fails_naming_it(capsys, monkeypatch, model, command):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = kvray_main([command, "--set", "ray.address=127.0.0.1:1", "--set", f"model.model={model}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_FAILED and len(err) == 1, err
    assert "ray.address='127.0.0.1:1': nothing answers at 127.0.0.1:1" in err[0]
    assert "Connection refused" in err[0] and "ray status" in err[0]
    assert not ray.is_initialized()


def test_a_stale_auto_names_the_address_it_resolved_to(capsys, monkeypatch, model, tmp_path):
    # What a cluster that is gone leaves behind: its address in <RAY_TMPDIR>/ray/ray_current_cluster.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    # and no Ray process left running: with exactly one other cluster on the host (another test run's),
    # Ray's "auto" takes that cluster over the file.
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    code = kvray_main(["info", "--set", f"model.model={model}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_FAILED and len(err) == 1, err
    assert "RAY_ADDRESS='auto' (resolved to 127.0.0.1:1): nothing answers" in err[0]


def test_ctrl_c_while_connecting_exits_130_in_one_line(model):
    silent = socket.socket()  # accepts connections and never answers: ray.init waits on it
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent.settimeout(120)
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "info",
            "--set",
            f"ray.address={address}",
            "--set",
            f"model.model={model}",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        preexec_fn=sigint_as_in_a_terminal,
    )
    held: list[socket.socket] = []
    try:
        held += [silent.accept()[0] for _ in range(2)]  # kvray's reachability check, then ray.init's GCS client
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
        silent.close()
    for conn in held:
        conn.close()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "kvray: interrupted" in err and "Traceback" not in err
