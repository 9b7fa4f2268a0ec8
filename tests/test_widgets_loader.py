"""The page-side loader of plotly.js (``gpudash/widgets/static/loader.js``), run in Node with
stand-in widget models and a clock the test moves: who is asked for the library, and when.
Skips where Node is not installed; the browser tests run the same code in JupyterLab."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import gpudash.widgets

LOADER = Path(gpudash.widgets.__file__).parent / "static" / "loader.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's loader")

# Models A, B... wait for the library, B registered after A. Each stands in for a widget
# model and its kernel: `busy` ms after an ask the kernel handles it: it answers with the
# library (a module that exports {ok: 1}) unless it still has `drop` asks to lose, then says
# idle (its status for the ask). A `mute` model's asks go nowhere: never handled. The clock
# runs the timers in order.
HARNESS = r"""
const fs = require("fs");
const [src, spec] = [fs.readFileSync(process.argv[1], "utf8"), JSON.parse(process.argv[2])];
let now = 0; const timers = [];
const setT = (fn, ms) => { const t = { at: now + ms, fn }; timers.push(t); return t; };
const clearT = (t) => { const i = timers.indexOf(t); if (i >= 0) timers.splice(i, 1); };
const loadPlotly = new Function("setTimeout", "clearTimeout", src + "\nreturn loadPlotly;")(setT, clearT);
const asks = [];
const models = spec.models.map(({ name, mute, drop, busy }) => {
  const handlers = [];
  let lost = 0;
  const m = {
    get: () => "v1",
    on: (_ev, fn) => handlers.push(fn),
    off: (_ev, fn) => handlers.splice(handlers.indexOf(fn), 1),
    send: (_content, callbacks) => {
      asks.push([name, now]);
      if (mute) return;
      setT(() => {
        if (lost++ >= (drop || 0)) {
          const body = new TextEncoder().encode("module.exports = { ok: 1 };");
          handlers.slice().forEach((fn) => fn({ type: "lib" }, [body]));
        }
        callbacks.iopub.status({ content: { execution_state: "idle" } });
      }, busy || 0);
    },
  };
  return m;
});
let entry;
for (const m of models) entry = loadPlotly(m);
(async () => {
  let loaded = null;
  entry.then((lib) => { loaded = [lib.ok, now]; });
  while (!loaded && timers.length && now < 600000) {
    timers.sort((a, b) => a.at - b.at);
    const t = timers.shift();
    now = t.at;
    t.fn();
    for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
  }
  console.log(JSON.stringify({ asks, loaded }));
})();
"""


def run_loader(models: list[dict]) -> dict:
    out = subprocess.run([NODE, "-e", HARNESS, str(LOADER), json.dumps({"models": models})],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_an_ask_the_kernel_handled_without_an_answer_is_repeated_within_a_second():
    # the kernel's first answer is lost (a reload while it was sent; a message dropped on a
    # deleted subshell): the model that handled it is asked again 1 s later
    got = run_loader([{"name": "A", "drop": 1}, {"name": "B"}])
    assert got["asks"] == [["A", 0], ["A", 1000]], got
    assert got["loaded"] == [1, 1000], got


def test_repeats_of_handled_asks_wait_longer_each_time():
    got = run_loader([{"name": "A", "drop": 3}])
    assert got["asks"] == [["A", 0], ["A", 1000], ["A", 3000], ["A", 7000]], got
    assert got["loaded"] == [1, 7000], got


def test_a_busy_kernel_is_asked_once_and_the_library_comes_once():
    # a kernel running cells for 25 s takes the ask after them: asking again before would
    # have the bundle sent twice
    got = run_loader([{"name": "A", "busy": 25000}, {"name": "B", "busy": 25000}])
    assert got["asks"] == [["A", 0]], got
    assert got["loaded"] == [1, 25000], got


def test_an_ask_that_went_nowhere_is_repeated_through_the_next_model():
    # A has no live comm (its asks are never handled): after 30 s, B, the latest, is asked
    got = run_loader([{"name": "A", "mute": True}, {"name": "B"}])
    assert got["asks"] == [["A", 0], ["B", 30000]], got
    assert got["loaded"] == [1, 30000], got
    # the latest first, then the one before, ...: a model that never answers is not asked for
    # ever
    got = run_loader([{"name": "A", "mute": True}, {"name": "B", "mute": True},
                      {"name": "C"}])
    assert got["asks"] == [["A", 0], ["C", 30000]], got
    assert got["loaded"] == [1, 30000], got
    got = run_loader([{"name": "A"}, {"name": "B", "mute": True}, {"name": "C", "mute": True}])
    assert got["asks"] == [["A", 0]], got          # A answers at once: nothing more
    got = run_loader([{"name": "A", "mute": True}, {"name": "B"}, {"name": "C", "mute": True}])
    assert got["asks"] == [["A", 0], ["C", 30000], ["B", 90000]], got
