// gpudash's front-end modules start with this (gpudash/widgets/dashboard.py, plot.py): the
// page-wide state they share (globalThis.__gpudash) and plotly.js, loaded once per page.
// A module asks its kernel for the library (a "lib" message, answered with the gzip-compressed
// bundle) only when the page does not have that version yet; every dashboard and plot of the
// page then uses the same copy.

const G = (globalThis.__gpudash = globalThis.__gpudash || { libs: {}, views: [] });

function u8(buf) {
  if (buf instanceof Uint8Array) return buf;
  if (buf instanceof ArrayBuffer) return new Uint8Array(buf);
  return new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
}

// An answer can be lost: a page reloaded while its widgets were being restored from the kernel
// can hold a model whose messages never come back. Every module that waits listens on its own
// model; when no answer has come, the request goes again after 8 s, then 16 s, 32 s and so on
// (so a slow kernel is not sent a second request at once), each time through the next of them,
// the latest first: a model that never answers is then not asked for ever.
const LIB_RETRY_MS = 8000;

function loadPlotly(model) {
  const version = model.get("lib_version");
  let entry = G.libs[version];
  if (!entry) {
    let resolve, reject;
    entry = G.libs[version] = new Promise((a, b) => { resolve = a; reject = b; });
    entry.waiting = [];
    entry.settled = false;
    entry.take = async (msg, buffers) => {
      if (entry.settled) return;
      entry.settled = true;
      clearTimeout(entry.timer);
      for (const [m, fn] of entry.waiting) m.off("msg:custom", fn);
      entry.waiting = [];
      try {
        const bytes = u8(buffers[0]);
        let text;
        if (msg.encoding === "gzip") {
          const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
          text = await new Response(stream).text();
        } else {
          text = new TextDecoder().decode(bytes);
        }
        const module = { exports: {} };
        new Function("module", "exports", "define", text)(module, module.exports, undefined);
        G.libBytes = (G.libBytes || 0) + bytes.byteLength;
        G.libLoads = (G.libLoads || 0) + 1;
        resolve(module.exports);
      } catch (err) {
        delete G.libs[version];
        reject(err);
      }
    };
    let turn = 0; // the retries so far: the latest model first, then the one before, ...
    const ask = (retry) => {
      const n = entry.waiting.length;
      const pick = n ? entry.waiting[n - 1 - (retry ? turn++ % n : 0)] : undefined;
      if (pick) pick[0].send({ type: typeof DecompressionStream === "undefined" ? "lib-raw" : "lib" });
    };
    let wait = LIB_RETRY_MS;
    const again = () => {
      if (entry.settled) return;
      G.libAsks = (G.libAsks || 0) + 1;
      ask(true);
      wait *= 2;
      entry.timer = setTimeout(again, wait);
    };
    entry.ask = ask;
    entry.timer = setTimeout(again, wait);
  }
  if (!entry.settled && !entry.waiting.some(([m]) => m === model)) {
    const onMsg = (msg, buffers) => {
      if (msg && msg.type === "lib") entry.take(msg, buffers || []);
    };
    model.on("msg:custom", onMsg);
    entry.waiting.push([model, onMsg]);
    if (entry.waiting.length === 1) entry.ask();
  }
  return entry;
}
