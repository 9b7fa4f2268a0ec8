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

function loadPlotly(model) {
  const version = model.get("lib_version");
  if (G.libs[version]) return G.libs[version];
  G.libs[version] = new Promise((resolve, reject) => {
    const onMsg = async (msg, buffers) => {
      if (!msg || msg.type !== "lib") return;
      model.off("msg:custom", onMsg);
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
    model.on("msg:custom", onMsg);
    model.send({ type: typeof DecompressionStream === "undefined" ? "lib-raw" : "lib" });
  });
  return G.libs[version];
}
