"""Helpers for the browser tests: a throwaway JupyterLab server on 127.0.0.1 and headless
Chromium (Debian's ``/usr/bin/chromium``; Playwright never downloads a browser).

Nothing here touches the network: the server listens on 127.0.0.1 only, its news feed, update
check and extension manager (PyPI) are off, and Chromium runs without its background
networking. Every process is started in its own process group so that teardown can end it
and its children (the kernels) together.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
ASSETS = REPO / "assets"

CHROMIUM = Path(os.environ.get("GPUDASH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: The environment of the server and so of its kernels: always a simulated 16 GiB device.
SIMULATE = "1x16GiB"

#: A PyTorch session of 1,000 segments and one 6 GiB expandable segment (80 GiB device), each
#: block labelled with the line that allocated it, and its dashboard: the segment map at a real
#: size (``tests/test_browser.py``, ``benchmarks/bench_browser.py``, ``make_assets.py``).
MANY_SEGMENTS = """\
import gpudash, numpy as np
s = gpudash.Session(allocator="torch", simulate="80GiB", record_stacks=True)
rng = np.random.default_rng(0)
keep = []
for i in range(1000):
    with s.label(f"layer {i % 12}"):
        keep.append(s.allocate(int(rng.integers(12, 60) << 20) + int(rng.integers(0, 1 << 20))))
for p in keep[::3]:   # freed: PyTorch keeps their segments cached
    s.free(p)
s.configure(expandable_segments=True)
big = s.allocate(6 << 30)
dash = gpudash.Dashboard(s)
dash"""

#: A small training loop over a gpudash session, as a module of the notebook's folder
#: (``train.py``): weights and Adam's state made once, then steps whose forward pass keeps
#: an activation per layer until the backward pass frees them, gradients until the optimizer
#: step. ``compute`` stands in for the GPU's work, so that refreshes land mid-step.
HOLDERS_TRAIN_PY = '''\
"""A small MLP trained on a gpudash session (the blocks stand in for tensors)."""
import time

FP32 = 4


def compute(seconds):
    time.sleep(seconds)


class Linear:
    def __init__(self, sess, n_in, n_out):
        self.sess, self.n_out = sess, n_out
        self.weight = sess.allocate(n_in * n_out * FP32)
        self.bias = sess.allocate(n_out * FP32)

    def forward(self, batch):
        out = self.sess.allocate(batch * self.n_out * FP32)
        compute(0.05)
        return out


class MLP:
    def __init__(self, sess, sizes):
        self.layers = [Linear(sess, a, b) for a, b in zip(sizes, sizes[1:])]

    def forward(self, batch):
        return [layer.forward(batch) for layer in self.layers]


def backward(sess, model, activations):
    grads = []
    for layer, act in zip(reversed(model.layers), reversed(activations)):
        grads.append(sess.allocate(sess.devices[0].allocator.allocated_size(layer.weight)))
        compute(0.03)
        sess.free(act)
    return grads


class Adam:
    def __init__(self, sess, model):
        self.sess = sess
        self.exp_avg = [sess.allocate(sess.devices[0].allocator.allocated_size(l.weight))
                        for l in model.layers]
        self.exp_avg_sq = [sess.allocate(sess.devices[0].allocator.allocated_size(l.weight))
                           for l in model.layers]

    def step(self, grads):
        for g in grads:
            update = self.sess.allocate(self.sess.devices[0].allocator.allocated_size(g))
            compute(0.01)
            self.sess.free(update)
            self.sess.free(g)


def train_step(sess, model, opt, batch):
    activations = model.forward(batch)
    grads = backward(sess, model, activations)
    opt.step(grads)
'''

#: The notebook of the holders view: a session recording stacks, its dashboard, the model
#: made in one ``%%gpudash_track`` cell and trained in the next (labels ``cell [N]``).
HOLDERS_CELLS = (
    ("%load_ext gpudash\nimport gpudash\nfrom train import MLP, Adam, train_step\n"
     "sess = gpudash.default_session(record_stacks=True)\n"
     "dash = gpudash.Dashboard(sess)\ndash"),
    ("%%gpudash_track\nmodel = MLP(sess, (8192, 8192, 8192, 4096, 1024))\n"
     "opt = Adam(sess, model)"),
    "%%gpudash_track\nfor step in range(4):\n    train_step(sess, model, opt, batch=4096)",
)

#: JupyterLab settings for the test user: no windowing (every cell stays in the DOM, so the
#: figures of cells scrolled away are still there), no news and no update checks.
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
    },
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
}

#: Lab extensions that would reach the network or get in the way of a scripted page.
_DISABLED_EXTENSIONS = {
    "@jupyterlab/extensionmanager-extension": True,
    "@jupyterlab/apputils-extension:announcements": True,
}


def missing_browser_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (install Debian's chromium package)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        return f"the playwright package is not installed ({exc})"
    try:
        import jupyterlab  # noqa: F401
    except ImportError as exc:
        return f"jupyterlab is not installed ({exc})"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """End ``proc`` and everything in its process group: SIGTERM, then SIGKILL."""
    if proc is None:
        return
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        elif proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; make sure no kernel of the group lingers.
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def _kill_processes_mentioning(text: str) -> None:
    """SIGKILL every process of ours whose command line mentions ``text`` (Linux /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class LabServer:
    """JupyterLab on 127.0.0.1 serving a copy of the notebooks, with a random token.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, workdir: Path, notebooks: Path = NOTEBOOKS, repo: Path = REPO) -> None:
        self.workdir = Path(workdir)
        self.repo = Path(repo)  # the checkout whose gpudash the kernels import
        self.root = self.workdir / "notebooks"
        self.home = self.workdir / "jupyter"
        self.log_path = self.workdir / "jupyterlab.log"
        self.token = secrets.token_hex(24)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log: Any = None
        self._notebooks = Path(notebooks)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    def _prepare(self) -> dict[str, str]:
        shutil.copytree(self._notebooks, self.root,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        settings = self.home / "lab-user-settings"
        for rel, values in _LAB_SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        config = self.home / "config"
        (config / "labconfig").mkdir(parents=True, exist_ok=True)
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": _DISABLED_EXTENSIONS}))
        for sub in ("data", "runtime", "workspaces", "ipython"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({
            "GPUDASH_SIMULATE": SIMULATE,
            # The kernels import the gpudash of this checkout (or of ``repo``).
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.repo), env.get("PYTHONPATH", "")) if p),
            "JUPYTER_CONFIG_DIR": str(config),
            "JUPYTER_RUNTIME_DIR": str(self.home / "runtime"),
            "JUPYTER_DATA_DIR": str(self.home / "data"),
            "IPYTHONDIR": str(self.home / "ipython"),
            "JUPYTER_PLATFORM_DIRS": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "no_proxy": "127.0.0.1,localhost",
            "NO_PROXY": "127.0.0.1,localhost",
        })
        return env

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            # ServerApp.token's current spelling (jupyter_server >= 2).
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True",
            # Notebook 7 (/tree, /notebooks/...) is served too, where installed
            "--JupyterNotebookApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={self.home / 'lab-user-settings'}",
            f"--LabApp.workspaces_dir={self.home / 'workspaces'}",
        ] + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])

    def start(self, timeout: float = 60.0) -> "LabServer":
        env = self._prepare()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=self.root, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        status = f"{self.base_url}/api/status?token={self.token}"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(status, timeout=2) as resp:
                    if resp.status == 200:
                        json.load(resp)
                        return self
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer {self.base_url}/api/status in "
                                   f"{timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def api(self, method: str, path: str) -> Any:
        """Call the server's REST API (``path`` like ``api/sessions``); the JSON answer."""
        req = urllib.request.Request(f"{self.base_url}/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """End every session and kernel (between tests); errors are ignored."""
        try:
            for sess in self.api("GET", "api/sessions"):
                self.api("DELETE", f"api/sessions/{sess['id']}")
            for kernel in self.api("GET", "api/kernels"):
                self.api("DELETE", f"api/kernels/{kernel['id']}")
        except (urllib.error.URLError, OSError, ValueError):
            pass

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server and its kernels. Kernels run in sessions of their own (jupyter_client
        starts them so), out of the server's process group: they are shut down through the
        API first, and any left (a server that no longer answers) are killed by their
        connection files, which live under this server's runtime folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.shutdown_kernels()
        kill_group(self.proc)
        self.proc = None
        _kill_processes_mentioning(str(self.home))
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LabServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_chromium(playwright: Any) -> Any:
    """Debian's Chromium, headless, with no background networking."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                      headless=True, chromium_sandbox=False)


# ------------------------------------------------------------------------------------------
# JupyterLab page helpers. They use ``window.jupyterapp`` (exposed by
# ``--LabApp.expose_app_in_browser``) to run commands, and the DOM to read what is shown.
# ------------------------------------------------------------------------------------------

JS_NOTEBOOK = "window.jupyterapp.shell.currentWidget"


def wait_for_notebook(page: Any, timeout_ms: int = 90_000) -> None:
    """Wait until the app is up, a notebook is the current widget and its kernel is idle."""
    page.wait_for_function(
        "() => !!(window.jupyterapp && window.jupyterapp.shell && "
        f"{JS_NOTEBOOK} && {JS_NOTEBOOK}.sessionContext && "
        f"{JS_NOTEBOOK}.sessionContext.session && "
        f"{JS_NOTEBOOK}.sessionContext.session.kernel && "
        f"{JS_NOTEBOOK}.sessionContext.session.kernel.status === 'idle')",
        timeout=timeout_ms, polling=250)


def command(page: Any, name: str, args: dict | None = None) -> Any:
    """Run a JupyterLab command, as a menu item or the command palette would."""
    return page.evaluate("([name, args]) => window.jupyterapp.commands.execute(name, args)",
                         [name, args or {}])


def kernel_status(page: Any) -> str:
    return page.evaluate(
        f"() => {{ const w = {JS_NOTEBOOK}; const k = w && w.sessionContext.session && "
        "w.sessionContext.session.kernel; return k ? k.status : 'none'; }")


def wait_until_all_ran(page: Any, timeout_ms: int = 120_000) -> None:
    """Wait until every code cell of the current notebook has an execution count and the
    kernel is idle (no cell queued or running)."""
    page.wait_for_function(
        f"""() => {{
            const w = {JS_NOTEBOOK};
            if (!w || !w.content) return false;
            const k = w.sessionContext.session && w.sessionContext.session.kernel;
            if (!k || k.status !== 'idle') return false;
            const cells = w.content.widgets.filter(c => c.model.type === 'code');
            return cells.length > 0 && cells.every(c =>
                c.model.executionCount !== null &&
                !(c.promptNode && c.promptNode.textContent.includes('*')));
        }}""", timeout=timeout_ms, polling=500)


def cell_errors(page: Any) -> list[str]:
    """The error outputs (``ename: evalue``) of the current notebook's cells."""
    return page.evaluate(
        f"""() => {{
            const out = [];
            for (const c of {JS_NOTEBOOK}.content.widgets) {{
                if (c.model.type !== 'code') continue;
                const outputs = c.model.outputs;
                for (let i = 0; i < outputs.length; i++) {{
                    const o = outputs.get(i).toJSON();
                    if (o.output_type === 'error') out.push(o.ename + ': ' + o.evalue);
                }}
            }}
            return out;
        }}""")


def run_code_in_new_cell(page: Any, source: str, timeout_ms: int = 60_000) -> str:
    """Append a code cell at the end of the current notebook, run it through the notebook
    UI (``notebook:run-cell``) and return the text of its output area as shown."""
    n = page.evaluate(
        f"""(source) => {{
            const w = {JS_NOTEBOOK};
            const nb = w.content;
            nb.activeCellIndex = nb.widgets.length - 1;
            return window.jupyterapp.commands.execute('notebook:insert-cell-below').then(() => {{
                nb.activeCell.model.sharedModel.setSource(source);
                return nb.activeCellIndex;
            }});
        }}""", source)
    command(page, "notebook:run-cell")
    page.wait_for_function(
        f"""(n) => {{
            const w = {JS_NOTEBOOK};
            const cell = w.content.widgets[n];
            const k = w.sessionContext.session.kernel;
            return cell && cell.model.executionCount !== null && k.status === 'idle' &&
                cell.model.outputs.length > 0;
        }}""", arg=n, timeout=timeout_ms, polling=250)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(n)
    return cell.locator(".jp-Cell-outputArea").inner_text()
