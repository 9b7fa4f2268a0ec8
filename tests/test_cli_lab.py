"""``gpudash lab``: the JupyterLab command line it builds, and one real start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gpudash import cli
from gpudash.cli import lab_command, main

ROOT = Path(__file__).resolve().parent.parent


def _args(*argv: str):
    args, extra = cli._parser().parse_known_args(["lab", *argv])
    return args, extra


def test_lab_opens_the_quickstart_notebook_not_the_launcher():
    args, extra = _args()
    cmd, cwd, _ = lab_command(args, extra, is_root=False)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert cwd == ROOT / "notebooks"
    assert f"--ServerApp.root_dir={ROOT / 'notebooks'}" in cmd
    assert "--LabApp.default_url=/lab/tree/01_quickstart.ipynb" in cmd
    assert "--ServerApp.port=8888" in cmd
    assert "--allow-root" not in cmd


def test_lab_as_root_passes_allow_root_and_says_so(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    assert main(["lab", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "running as root: passing --allow-root to JupyterLab" in out
    assert out.strip().splitlines()[-1].endswith("--allow-root")
    args, extra = _args("--allow-root")  # given by hand: not twice
    cmd, _, notes = lab_command(args, extra, is_root=True)
    assert cmd.count("--allow-root") == 1 and not notes


def test_lab_takes_ip_token_port_and_no_browser():
    args, extra = _args("--ip", "0.0.0.0", "--token", "s3cret", "--port", "9999",
                        "--no-browser")
    assert extra == []
    cmd, _, _ = lab_command(args, extra, is_root=False)
    for part in ("--ServerApp.ip=0.0.0.0", "--IdentityProvider.token=s3cret",
                 "--ServerApp.port=9999", "--no-browser"):
        assert part in cmd


def test_lab_passes_further_arguments_through(capsys):
    assert main(["lab", "--dry-run", "--ServerApp.port_retries=0", "--", "--debug"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("--ServerApp.port_retries=0 --debug")
    assert " -- " not in line


def test_unknown_arguments_of_other_commands_are_still_errors(capsys):
    assert main(["info", "--bogus"]) != 0
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_lab_from_a_wheel_copies_the_packaged_notebook(tmp_path, monkeypatch):
    """Installed from a wheel there is no notebooks/ folder beside the package: the copy in
    gpudash/notebooks/ is written to the current directory once, and reused after."""
    pkg = tmp_path / "site" / "gpudash"
    (pkg / "notebooks").mkdir(parents=True)
    (pkg / "notebooks" / "01_quickstart.ipynb").write_text('{"cells": []}')
    monkeypatch.setattr(cli, "__file__", str(pkg / "cli.py"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args, extra = _args("--dry-run")
    _, cwd, notes = lab_command(args, extra, is_root=False, write=False)
    assert not (work / "gpudash_01_quickstart.ipynb").exists()  # a dry run writes nothing
    cmd, cwd, notes = lab_command(args, extra, is_root=False)
    assert cwd == work
    assert (work / "gpudash_01_quickstart.ipynb").read_text() == '{"cells": []}'
    assert "--LabApp.default_url=/lab/tree/gpudash_01_quickstart.ipynb" in cmd
    assert notes == [f"copied the quick-start notebook to {work / 'gpudash_01_quickstart.ipynb'}"]
    (work / "gpudash_01_quickstart.ipynb").write_text("edited")
    lab_command(args, extra, is_root=False)
    assert (work / "gpudash_01_quickstart.ipynb").read_text() == "edited"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_lab_starts_a_server_that_answers_with_the_token(tmp_path):
    pytest.importorskip("jupyterlab")
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudash", "lab", "--ip", "127.0.0.1", "--port", str(port),
         "--token", "t0ken", "--no-browser", "--ServerApp.port_retries=0",
         "--LabApp.workspaces_dir=" + str(tmp_path / "ws"),
         "--LabApp.user_settings_dir=" + str(tmp_path / "settings")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        status = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/status?token=t0ken", timeout=5) as r:
                    status = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.5)
        assert status is not None, proc.stdout.read().decode() if proc.poll() is not None else ""
        assert "started" in status
        with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/contents/01_quickstart.ipynb?content=0&token=t0ken",
                timeout=10) as r:
            assert json.loads(r.read())["type"] == "notebook"  # the root is notebooks/
        with pytest.raises(urllib.error.HTTPError) as info:  # the token is required
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5)
        assert info.value.code == 403
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
