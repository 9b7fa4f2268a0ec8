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

// An ask can go unanswered. The kernel says when it has handled each one (its idle status for
// the message): one handled without an answer (a kernel that could not read the bundle; a
// message it dropped, as ipykernel 7 drops one routed to a deleted subshell) is asked again
// after LIB_AGAIN_MS through the same model, the waits doubling. One not handled yet is not
// repeated while the kernel may still take it in turn (a kernel running cells takes comm
// messages after them: asking again would send the bundle twice), only after LIB_LOST_MS, the
// waits doubling, and through the next model that waits, the latest first (a message that went
// nowhere: a model without a live comm is not asked for ever).
const LIB_AGAIN_MS = 1000;
const LIB_LOST_MS = 30000;
const LIB_WAIT_MAX_MS = 60000;

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
    let turn = 0; // models passed over so far: the latest first, then the one before, ...
    let again = LIB_AGAIN_MS, lost = LIB_LOST_MS, last;
    const ask = (next) => {
      if (entry.settled) return;
      clearTimeout(entry.timer);
      const n = entry.waiting.length;
      if (!n) return;
      // a model that handled the last ask is asked again; else the next in turn but that one
      let pick = last === undefined ? entry.waiting[n - 1] : last;
      if (last !== undefined && (next || !entry.waiting.includes(last))) {
        for (let k = 0; k < n; k++) {
          pick = entry.waiting[n - 1 - (turn++ % n)];
          if (pick !== last) break;
        }
      }
      if (entry.asked) G.libAsks = (G.libAsks || 0) + 1;
      const mine = (entry.asked = (entry.asked || 0) + 1);
      last = pick;
      const status = (msg) => {
        // the latest ask only, handled, and no answer came before its idle status
        if (mine !== entry.asked || entry.settled || !msg || !msg.content ||
            msg.content.execution_state !== "idle") return;
        entry.asked += 1;    // one repeat per ask
        clearTimeout(entry.timer);
        entry.timer = setTimeout(() => ask(false), again);
        again = Math.min(again * 2, LIB_WAIT_MAX_MS);
      };
      entry.timer = setTimeout(() => ask(true), lost);
      lost = Math.min(lost * 2, LIB_WAIT_MAX_MS);
      pick[0].send({ type: typeof DecompressionStream === "undefined" ? "lib-raw" : "lib" },
        { iopub: { status } });
    };
    entry.ask = ask;
  }
  if (!entry.settled && !entry.waiting.some(([m]) => m === model)) {
    const onMsg = (msg, buffers) => {
      if (msg && msg.type === "lib") entry.take(msg, buffers || []);
    };
    model.on("msg:custom", onMsg);
    entry.waiting.push([model, onMsg]);
    if (entry.waiting.length === 1) entry.ask(true);
  }
  return entry;
}
