"""What a page sends to gpudash's widgets reaches them in a kernel with subshells.

ipykernel 7 routes a comm's incoming messages to the subshell of the kernel's parent message
when the comm last sent. The dashboard sends from its refresher thread, whose parent is the
last message the kernel handled, possibly on a subshell that the page deletes at once
(ipywidgets' control comm's, after a restore). The test makes exactly that happen in a real
kernel, then sends the dashboard a hello from the main shell, as a page that was reloaded
does, and checks that the dashboard got it (it was dropped: the browser test saw a reloaded
page stay at "gpudash: loading the views..." on a busy machine).
"""

from __future__ import annotations

import json
import os
import queue
import sys
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


def _reply(channel, msg_id: str, timeout: float = 30.0) -> dict:
    while True:
        msg = channel.get_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg


def _run(kc, code: str) -> str:
    """Run ``code`` on the main shell; its printed text."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)


@pytest.fixture()
def kernel():
    km = jupyter_client.KernelManager(kernel_name="python3")
    env = dict(os.environ, GPUDASH_SIMULATE="1x4GiB",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        info = kc.kernel_info(reply=True)["content"]
        if "kernel subshells" not in info.get("supported_features", []):
            pytest.skip("this ipykernel has no subshells (ipykernel 7 brings them)")
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _control(kc, msg_type: str, content: dict) -> dict:
    msg = kc.session.msg(msg_type, content)
    kc.control_channel.send(msg)
    return _reply(kc.control_channel, msg["header"]["msg_id"])["content"]


def test_a_message_from_the_page_reaches_the_dashboard_after_its_subshell_is_gone(kernel):
    kc = kernel
    comm_id = _run(kc, "import threading, time\nimport gpudash\n"
                       "from gpudash.widgets import Dashboard\n"
                       "sess = gpudash.Session(simulate='1x4GiB')\ndash = Dashboard(sess)\n"
                       "print(dash.comm.comm_id)").strip()
    subshell = _control(kc, "create_subshell_request", {})["subshell_id"]
    # The refresher's kind of send: from a thread, once the kernel's last parent is a message
    # handled on the subshell (as ipywidgets' control comm's is, on a page that restores)
    _run(kc, "k = get_ipython().kernel\n"
             "def send_from_a_thread():\n"
             "    while k.get_parent().get('header', {}).get('subshell_id') is None:\n"
             "        time.sleep(0.005)\n"
             "    dash._post('update', {'type': 'update'})\n"
             "sender = threading.Thread(target=send_from_a_thread)\nsender.start()")
    # a cell on the subshell: its message is the kernel's last parent while it runs
    on_subshell = kc.session.msg("execute_request", {
        "code": "time.sleep(0.5)", "silent": False, "store_history": False,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    on_subshell["header"]["subshell_id"] = subshell
    kc.shell_channel.send(on_subshell)
    _reply(kc.shell_channel, on_subshell["header"]["msg_id"])
    assert _run(kc, "sender.join(10); print(sender.is_alive())").strip() == "False"
    # the page closes its control comm: the subshell goes
    assert _control(kc, "delete_subshell_request",
                    {"subshell_id": subshell})["status"] == "ok"
    # a reloaded page says hello from the main shell
    hello = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "custom", "content": {"type": "hello"}}})
    kc.shell_channel.send(hello)
    answered = False
    try:
        while True:
            msg = kc.get_iopub_msg(timeout=10)
            if (msg["msg_type"] == "comm_msg"
                    and msg["parent_header"].get("msg_id") == hello["header"]["msg_id"]):
                data = msg["content"]["data"]
                content = data.get("content", {}) if isinstance(data, dict) else {}
                answered = content.get("type") == "snapshot" or answered
            if (msg["msg_type"] == "status"
                    and msg["parent_header"].get("msg_id") == hello["header"]["msg_id"]
                    and msg["content"]["execution_state"] == "idle"):
                break
    except queue.Empty:
        pass
    assert _run(kc, "print(dash._hellos)").strip() == "1"
    assert answered, "the dashboard did not answer the page's hello with a snapshot"
    _run(kc, "dash.close(); sess.close()")
