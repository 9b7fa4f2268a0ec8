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

# Models A and B wait for the library; B registered last. `live` models answer an ask with
# the library (a module that exports {ok: 1}); `drop` counts asks a model loses first (the
# kernel's first answer lost in a reload). The clock runs the retry timers in order.
HARNESS = r"""
const fs = require("fs");
const [src, spec] = [fs.readFileSync(process.argv[1], "utf8"), JSON.parse(process.argv[2])];
let now = 0; const timers = [];
const setT = (fn, ms) => { const t = { at: now + ms, fn }; timers.push(t); return t; };
const clearT = (t) => { const i = timers.indexOf(t); if (i >= 0) timers.splice(i, 1); };
const loadPlotly = new Function("setTimeout", "clearTimeout", src + "\nreturn loadPlotly;")(setT, clearT);
const asks = [];
const models = spec.models.map(({ name, live, drop }) => {
  const handlers = [];
  let lost = 0;
  const m = {
    get: () => "v1",
    on: (_ev, fn) => handlers.push(fn),
    off: (_ev, fn) => handlers.splice(handlers.indexOf(fn), 1),
    send: () => {
      asks.push([name, now]);
      if (!live || lost++ < drop) return;
      const body = new TextEncoder().encode("module.exports = { ok: 1 };");
      Promise.resolve().then(() => handlers.slice().forEach((fn) => fn({ type: "lib" }, [body])));
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


def test_a_retry_goes_through_each_waiting_model_in_turn():
    # A's first answer is lost; B, the latest, never answers (a model restored with a page
    # reload whose messages never come back): the retries must reach A again
    got = run_loader([{"name": "A", "live": True, "drop": 1},
                      {"name": "B", "live": False, "drop": 0}])
    assert got["asks"] == [["A", 0], ["B", 8000], ["A", 24000]], got
    assert got["loaded"] == [1, 24000], got


def test_the_first_retry_goes_through_the_latest_model_and_an_answer_ends_the_asking():
    got = run_loader([{"name": "A", "live": True, "drop": 1},
                      {"name": "B", "live": True, "drop": 0}])
    assert got["asks"] == [["A", 0], ["B", 8000]], got
    assert got["loaded"] == [1, 8000], got


def test_a_lone_model_is_asked_again_with_the_waits_doubling():
    got = run_loader([{"name": "A", "live": True, "drop": 3}])
    assert got["asks"] == [["A", 0], ["A", 8000], ["A", 24000], ["A", 56000]], got
    assert got["loaded"] == [1, 56000], got
