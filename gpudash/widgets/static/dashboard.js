// gpudash live dashboard (anywidget ES module, after loader.js). See
// gpudash/widgets/dashboard.py for the protocol: plotly.js once per page (asked for only when
// missing), a snapshot per hello, binary increments after it, one redraw per animation frame
// at most.

function f64(buf) {
  const b = u8(buf);
  const copy = new Uint8Array(b.byteLength);
  copy.set(b);
  return new Float64Array(copy.buffer);
}

// ---------------------------------------------------------------- units (gpudash.style)
const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

function fmtBytes(n) {
  n = Number(n);
  if (!isFinite(n)) return "-";
  const sign = n < 0 ? "-" : "";
  n = Math.abs(n);
  let i = 0;
  while (n >= 1024 && i < UNITS.length - 1) { n /= 1024; i++; }
  return sign + (i === 0 ? n.toFixed(0) : n.toFixed(2)) + " " + UNITS[i];
}

// A region of the chunk map: its start address and size ("0x7f0000000000 64.00 MiB").
function regionLabel(r) {
  return "0x" + Number(r[0]).toString(16) + " " + fmtBytes(r[1]);
}

// A short size for a row's offset ("512 MiB", "1.5 GiB"), as gpudash.style.format_size.
function fmtShort(n) {
  n = Number(n);
  if (n === 0) return "0 B";
  let i = 0;
  while (n >= 1024 && i < UNITS.length - 1) { n /= 1024; i++; }
  const t = Math.abs(n - Math.round(n)) < 1e-9 ? n.toFixed(0) : String(Number(n.toPrecision(3)));
  return t + " " + UNITS[i];
}

// Pixels per row of the segment / chunk map's initial view (gpudash.maplayout.ROW_PX), and
// the tallest the map's plot gets: more rows are a drag (pan) away.
const ROW_PX = 16;
const MAP_MAX_PX = 520;

// The binary unit an axis reads in: the largest with top >= 1 of it.
function unitFor(top) {
  let i = 0;
  let u = 1;
  while (i < UNITS.length - 1 && top >= u * 1024) { u *= 1024; i++; }
  return { scale: u, name: UNITS[i] };
}

// The fraction slider's readout, whatever set the fraction (the slider, %gpudash_config,
// code): "0.30 (limit 4.80 GiB)"; `unset` ("auto"; PyTorch's "not set") for no fraction
// (all the device allows); the limit reads "..." until the kernel has answered.
function fractionText(frac, auto, limit, unset) {
  return (auto ? (unset || "auto") : Number(frac).toFixed(2)) +
    " (limit " + (limit == null ? "..." : fmtBytes(limit)) + ")";
}

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;" }[c]));
}

const CSS = `
.gd-root{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;font-size:12px;color:#222}
.gd-head{display:flex;flex-wrap:wrap;gap:4px 16px;padding:4px 2px;align-items:baseline}
.gd-head b{font-size:14px}
.gd-banner{margin:4px 0;padding:6px 8px;border-radius:4px;background:#efe6f7;border-left:4px solid #9467bd}
.gd-over{background:#d62728;color:#fff;font-weight:bold;padding:2px 8px;border-radius:3px}
.gd-controls{display:flex;flex-wrap:wrap;gap:6px 12px;align-items:center;padding:4px 2px;border-top:1px solid #eee;border-bottom:1px solid #eee}
.gd-controls label{display:flex;gap:4px;align-items:center}
.gd-controls button{padding:2px 8px;cursor:pointer}
.gd-controls input[type=range]{width:180px}
.gd-note{color:#777;font-style:italic}
.gd-driver{font-size:12px;color:#444;margin:2px 0 6px}
.gd-controls input[type=number]{width:80px}
.gd-status{min-height:16px;color:#555;padding:2px;white-space:pre-line}
.gd-status.err{color:#d62728}
.gd-grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:8px}
.gd-cell{min-width:0;border:1px solid #f0f0f0;border-radius:4px;padding:2px}
.gd-title{font-weight:600;padding:2px 4px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.gd-plot{height:260px}
.gd-wide{grid-column:1 / -1}
.gd-title button{margin-left:8px;padding:0 8px;font-weight:normal;cursor:pointer}
.gd-hint{font-weight:normal;color:#777;margin-left:8px}
.gd-moment{font-weight:normal;background:#efe6f7;border-radius:3px;padding:0 4px;margin-left:6px}
.gd-none{height:260px;display:flex;align-items:center;justify-content:center;color:#777;text-align:center;padding:0 20px}
`;

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---------------------------------------------------------------- one rendered view
class View {
  constructor(model, root, Plotly) {
    this.model = model;
    this.root = root;
    this.Plotly = Plotly;
    this.setup = model.get("setup");
    this.C = this.setup.colors;
    this.views = model.get("views");
    this.ready = false;
    this.dirty = new Set();
    this.frame = 0;
    this.stats = { updates: 0, draws: 0, snapshots: 0, bytes: 0, replies: 0, drawMs: 0, ms: {} };
    this.visible = true;
    this.pending = {};
    this.inflight = {};
    this.previewing = {};   // sliders being dragged on a source that previews
    this.nextId = 1;
    this.build();
    if (typeof IntersectionObserver !== "undefined") {
      this.observer = new IntersectionObserver((entries) => {
        for (const e of entries) this.visible = e.isIntersecting;
        if (this.visible && this.dirty.size) this.schedule();
      });
      this.observer.observe(root);
    }
  }

  build() {
    const r = this.root;
    r.classList.add("gd-root");
    r.appendChild(el("style", {}, CSS));
    this.head = r.appendChild(el("div", { class: "gd-head" }));
    this.banner = r.appendChild(el("div", { class: "gd-banner", style: "display:none" }));
    this.controls = r.appendChild(el("div", { class: "gd-controls" }));
    this.status = r.appendChild(el("div", { class: "gd-status" }));
    this.driver = r.appendChild(el("div", { class: "gd-driver", style: "display:none" }));
    this.buildControls();
    this.grid = r.appendChild(el("div", { class: "gd-grid" }));
    this.cells = {};
    const titles = { timeline: "memory over time", heatmap: "address x time: bytes in use",
      chunkmap: "chunk map", bins: "bins", holders: "who holds the memory" };
    for (const name of ["timeline", "heatmap", "chunkmap", "bins", "holders"]) {
      if (!this.views.includes(name)) continue;
      const cls = name === "holders" ? "gd-cell gd-wide" : "gd-cell";
      const cell = this.grid.appendChild(el("div", { class: cls, "data-view": name }));
      const title = cell.appendChild(el("div", { class: "gd-title" }, titles[name]));
      const plot = cell.appendChild(el("div", { class: "gd-plot" }));
      const none = cell.appendChild(el("div", { class: "gd-none", style: "display:none" }));
      this.cells[name] = { cell, title, plot, none, drawn: false };
    }
    if (this.cells.holders) this.buildHoldersTitle(this.cells.holders);
    if (!this.views.includes("stats")) this.head.style.display = "none";
  }

  // The holders view's title: what it shows, the moment picked on the timeline (or a hint
  // that one can be), and a "live" button back to the latest state.
  buildHoldersTitle(cell) {
    const t = cell.title;
    t.textContent = "";
    cell.label = t.appendChild(el("span", { "data-holders": "title" }, "who holds the memory"));
    cell.moment = t.appendChild(el("span", { class: "gd-moment", "data-holders": "moment",
      style: "display:none" }));
    cell.hint = t.appendChild(el("span", { class: "gd-hint", "data-holders": "hint" },
      "click the timeline for another moment"));
    const live = t.appendChild(el("button", { "data-ctl": "holders-live", style: "display:none" },
      "live"));
    live.addEventListener("click", () => this.act("holders_at", null));
    cell.live = live;
  }

  buildControls() {
    const c = this.controls;
    const devs = this.setup.devices;
    this.ctl = {};
    if (devs.length > 1) {
      const lab = c.appendChild(el("label", {}, "device "));
      const sel = lab.appendChild(el("select", { "data-ctl": "device" }));
      devs.forEach((d, i) => sel.appendChild(el("option", { value: String(i) }, d)));
      sel.value = String(this.model.get("device"));
      sel.addEventListener("change", () => this.act("device", Number(sel.value)));
      this.ctl.device = sel;
    }
    // the allocator model's own controls (gpudash.models): built when its description
    // arrives with the first snapshot (buildModelControls)
    this.modelBox = c.appendChild(el("span", { style: "display:contents" }));
    this.specs = [];
    const pause = c.appendChild(el("button", { "data-ctl": "pause" }, "updates: live"));
    pause.addEventListener("click", () => this.act("pause", !this.paused));
    this.ctl.pause = pause;
    const rl = c.appendChild(el("label", {}, "refresh "));
    const rate = rl.appendChild(el("select", { "data-ctl": "rate" }));
    for (const hz of [1, 2, 4, 8, 15, 30]) rate.appendChild(el("option", { value: String(hz) }, hz + "/s"));
    rate.addEventListener("change", () => this.act("rate", Number(rate.value)));
    this.ctl.rate = rate;
    const restart = c.appendChild(el("button", { "data-ctl": "restart", style: "display:none" },
      "settings to restart with"));
    restart.addEventListener("click", () => this.act("restart"));
    this.ctl.restart = restart;
  }

  // One element per control the model lists: a fraction slider, an on/off button, a number
  // (a byte count in its unit), a button. Each sends its value; the kernel answers in words.
  buildModelControls(model) {
    const box = this.modelBox;
    while (box.firstChild) box.removeChild(box.firstChild);
    for (const spec of this.specs) delete this.ctl[spec.name];
    this.specs = model.controls || [];
    this.words = model.words || {};
    this.toggles = {};
    this.builtFor = model.name;
    for (const spec of this.specs) {
      const name = spec.name;
      if (spec.kind === "fraction") {
        const lab = box.appendChild(el("label", {}, spec.label + " "));
        const slider = lab.appendChild(el("input", { type: "range", min: "0.01", max: "1",
          step: "0.01", value: "1", "data-ctl": name }));
        const fval = lab.appendChild(el("span", { "data-ctl": name + "-value" }, ""));
        slider.addEventListener("input", () => {
          // the limit follows with the kernel's answer (applyControls); a source that
          // previews (shadow mode: a real job) says what the value would do while dragged,
          // and applies it when the slider is let go
          fval.textContent = fractionText(Number(slider.value), false, null);
          if (this.info && this.info.preview) {
            this.previewing[name] = true;   // the value shown is the one previewed
            this.preview(name, Number(slider.value));
          } else this.act(name, Number(slider.value), true);
        });
        slider.addEventListener("change", () => {
          if (!(this.info && this.info.preview)) return;
          delete this.previewing[name];
          this.act(name, Number(slider.value));
        });
        this.ctl[name] = slider;
        this.ctl[name + "Value"] = fval;
      } else if (spec.kind === "toggle") {
        const b = box.appendChild(el("button", { "data-ctl": name }, spec.label + ": ?"));
        b.addEventListener("click", () => this.act(name, !this.toggles[name]));
        b.addEventListener("mouseenter", () => {
          if (this.info && this.info.preview && !b.disabled) this.preview(name, !this.toggles[name]);
        });
        this.ctl[name] = b;
      } else if (spec.kind === "bytes" || spec.kind === "number") {
        const lab = box.appendChild(el("label", {}, spec.label + " "));
        const attrs = { type: "number", "data-ctl": name };
        if (spec.kind === "bytes") { attrs.min = "0"; attrs.step = "1"; }
        else {
          if (spec.min != null) attrs.min = String(spec.min);
          if (spec.max != null) attrs.max = String(spec.max);
          if (spec.step != null) attrs.step = String(spec.step);
          if (spec.empty) attrs.placeholder = spec.empty;
        }
        const input = lab.appendChild(el("input", attrs));
        // sent on Enter (the notebook would take the key otherwise) and on leaving the
        // field, once per value
        const commit = () => {
          if (input.value === input.dataset.sent) return;
          input.dataset.sent = input.value;
          if (spec.kind === "bytes") this.act(name, Math.round(Number(input.value) * spec.unit));
          else this.act(name, input.value === "" ? spec.empty_value : Number(input.value));
        };
        input.addEventListener("change", commit);
        input.addEventListener("input", () => {
          if (!(this.info && this.info.preview) || spec.kind !== "number") return;
          this.preview(name, input.value === "" ? spec.empty_value : Number(input.value));
        });
        input.addEventListener("keydown", (ev) => {
          if (ev.key !== "Enter") return;
          ev.preventDefault();
          ev.stopPropagation();
          commit();
        });
        this.ctl[name] = input;
      } else {
        const b = box.appendChild(el("button", { "data-ctl": name }, spec.label));
        b.addEventListener("click", () => this.act(name));
        this.ctl[name] = b;
      }
    }
  }

  // What a control's value would do, before it is applied (one in flight, the newest next).
  preview(name, value) {
    this.act("preview", { name, value }, true);
  }

  // Send a control; `coalesce` keeps one in flight per control and sends the newest value
  // when the answer comes (a dragged slider never queues).
  act(name, value, coalesce) {
    if (coalesce && this.inflight[name]) { this.pending[name] = value; return; }
    const id = this.nextId++;
    this.inflight[name] = { id, t: performance.now() };
    this.model.send({ type: "action", name, value, id });
  }

  onReply(msg) {
    this.stats.replies++;
    const f = this.inflight[msg.name];
    if (f && f.id === msg.id) {
      this.stats.lastReplyMs = performance.now() - f.t;
      delete this.inflight[msg.name];
    }
    this.status.textContent = (msg.ok ? "" : "refused: ") + msg.text + (msg.warning ? " - " + msg.warning : "");
    this.status.classList.toggle("err", !msg.ok);
    if (msg.controls) this.applyControls(Object.assign({}, msg.controls,
                                                       msg.ok ? {} : { refused: msg.name }));
    // the device shown (a refused device change puts the picker back)
    if (this.ctl.device && msg.device != null) this.ctl.device.value = String(msg.device);
    if (msg.name in this.pending) {
      const v = this.pending[msg.name];
      delete this.pending[msg.name];
      this.act(msg.name, v, true);
    }
  }

  // Who else is on the GPU (a watched framework): NVML's processes, and the framework's pool
  // against what the driver counts for this process; or why NVML cannot say.
  applyDriver(d) {
    const box = this.driver;
    if (!d) { box.style.display = "none"; return; }
    box.style.display = "";
    if (!d.available) { box.textContent = "GPU processes (NVML): " + (d.reason || "not available"); return; }
    const procs = (d.processes || []).map((p) => {
      const who = p.self ? ` (this process${p.framework ? ", " + p.framework : ""})` : "";
      return `${esc(p.name)} [${p.pid}]${esc(who)} ${p.used == null ? "n/a" : fmtBytes(p.used)}`;
    });
    let pool = "";
    if (d.driver != null && d.pool != null)
      pool = ` - the framework's pool ${fmtBytes(d.pool)} of ${fmtBytes(d.driver)} the driver counts ` +
        `for this process (${fmtBytes(d.outside || 0)} outside the pool: CUDA context, libraries)`;
    box.innerHTML = "<b>GPU processes (NVML):</b> " + (procs.length ? procs.join("; ") : "none listed") + pool;
  }

  applyControls(info) {
    const s = info.settings || {};
    this.info = info;
    this.applyDriver(info.driver);
    if (info.model && info.model.name !== this.builtFor) this.buildModelControls(info.model);
    const ctl = this.ctl;
    const words = this.words || {};
    const reason = info.disabled;
    const unavailable = info.unavailable || {};
    for (const spec of this.specs) {
      const e = ctl[spec.name];
      const v = spec.setting ? s[spec.setting] : null;
      if (spec.kind === "fraction") {
        const total = s.total || 0;
        // fraction unset (or 0: all the device allows): the limit's share, read "auto"
        const auto = !s.fraction;
        const frac = !auto ? s.fraction : (total && s.limit ? s.limit / total : null);
        // the settings in force, unless a newer value from the slider is on its way (then
        // its answer shows it); the handle is left alone while it has the focus (dragged)
        const sending = this.inflight[spec.name] || spec.name in this.pending ||
          spec.name in this.previewing;
        if (frac != null && !sending) {
          if (document.activeElement !== e) e.value = String(frac);
          ctl[spec.name + "Value"].textContent = fractionText(frac, auto, s.limit,
                                                               words.unset_fraction);
        }
      } else if (spec.kind === "toggle") {
        this.toggles[spec.name] = !!v;
        e.textContent = spec.label + ": " + (v == null ? "?" : (v ? "on" : "off"));
      } else if (spec.kind === "bytes") {
        if (v != null && document.activeElement !== e)
          e.value = e.dataset.sent = String(Math.round(v / spec.unit));
      } else if (spec.kind === "number") {
        // the value in force; after a refusal the field shows it again
        if (document.activeElement !== e || info.refused === spec.name)
          e.value = e.dataset.sent = v == null || v === 0 ? "" : String(v);
      }
      const why = reason || unavailable[spec.name];
      if (why) { e.setAttribute("disabled", ""); e.title = why; }
      else if (spec.needs_session && !info.session) {
        e.setAttribute("disabled", "");
        e.title = "deferred deletion lives in a gpudash.Session";
      } else { e.removeAttribute("disabled"); e.title = spec.tooltip || ""; }
    }
    this.paused = !!info.paused;
    ctl.pause.textContent = "updates: " + (this.paused ? "paused" : "live");
    ctl.rate.value = String(Math.round(info.rate_hz));
    ctl.restart.style.display = info.restart ? "" : "none";
    this.hasLayout = info.has_layout !== false;
    if (info.model) {
      this.binLabels = info.model.bin_labels;
      for (const [name, key] of [["chunkmap", "map"], ["bins", "bins"]])
        if (this.cells[name] && !this.cells[name].drawn) this.cells[name].title.textContent = words[key];
      if (this.cells.holders && this.holders) this.dirty.add("holders");
    }
  }

  // ------------------------------------------------------------ data in
  onMessage(msg, buffers) {
    if (!msg) return;
    if (msg.type === "reply") return this.onReply(msg);
    if (msg.type === "holders") {
      // a moment picked on the timeline, or live again: after a snapshot only (the
      // strings it names build on the page's table)
      if (!this.ready || msg.device !== this.model.get("device")) return;
      this.stats.bytes += buffers.reduce((a, b) => a + b.byteLength, 0);
      this.takeHolders(msg.holders, buffers);
      this.schedule();
      return;
    }
    if (msg.type !== "snapshot" && msg.type !== "update") return;
    if (msg.type === "update" && !this.ready) return;
    this.stats.bytes += buffers.reduce((a, b) => a + b.byteLength, 0);
    if (msg.type === "snapshot") {
      this.ready = true;
      this.stats.snapshots++;
      this.tl = { t: [], used: [], pool: [], limit: [] };
      this.heat = { cols: [], t: [] };
      if (msg.controls) this.applyControls(msg.controls);
      if (this.ctl.device) this.ctl.device.value = String(msg.device);
    } else {
      this.stats.updates++;
      if (msg.controls) this.applyControls(msg.controls);  // settings changed from code
    }
    this.now = msg.now;
    this.headline = msg.headline;
    const tl = f64(buffers[0]);
    const n = msg.timeline_n;
    for (let i = 0; i < n; i++) {
      this.tl.t.push(tl[i]); this.tl.used.push(tl[n + i]);
      this.tl.pool.push(tl[2 * n + i]); this.tl.limit.push(tl[3 * n + i]);
    }
    if (this.tl.t.length > 20000) for (const k of ["t", "used", "pool", "limit"]) this.tl[k].splice(0, 10000);
    const h = msg.heat;
    const hb = u8(buffers[1]);
    const ht = f64(buffers[2]);
    if (h.full) this.heat = { cols: [], t: [] };
    this.heat.rows = h.rows;
    this.heat.rowBytes = h.row_bytes;
    for (let j = 0; j < h.n; j++) {
      this.heat.cols.push(hb.slice(j * h.rows, (j + 1) * h.rows));
      this.heat.t.push(ht[j]);
    }
    const extra = this.heat.cols.length - h.max_columns;
    if (extra > 0) { this.heat.cols.splice(0, extra); this.heat.t.splice(0, extra); }
    if (msg.chunks) {
      const hb = u8(buffers[5]);
      const ids = new Int32Array(hb.byteLength / 4);
      new Uint8Array(ids.buffer).set(hb);
      // the holder strings this page lacks (base 0: a table afresh)
      const st = msg.chunks.strings || { base: 0, new: [] };
      if (!this.strings || st.base === 0) this.strings = [];
      this.strings.length = st.base;
      for (const x of st.new) this.strings.push(x);
      this.chunks = { meta: msg.chunks, cols: f64(buffers[3]), bins: f64(buffers[4]),
        holders: ids, regions: f64(buffers[6]), kinds: new Int8Array(u8(buffers[7]).slice().buffer) };
      this.dirty.add("chunkmap"); this.dirty.add("bins");
    }
    if (msg.holders) this.takeHolders(msg.holders, buffers);
    else if (msg.type === "snapshot") this.holders = null;
    this.dirty.add("head"); this.dirty.add("timeline"); this.dirty.add("heatmap");
    this.schedule();
  }

  // The holders' tree (gpudash/widgets/dashboard.py, Dashboard._tree_buffers): per node its
  // offset and bytes (f64), parent, blocks, name and text ids (int32), level and kind (int8).
  takeHolders(meta, buffers) {
    const st = meta.strings || { base: 0, new: [] };
    if (!this.strings || st.base === 0) this.strings = [];
    this.strings.length = st.base;
    for (const x of st.new) this.strings.push(x);
    const n = meta.n;
    const f = f64(buffers[meta.buf]);
    const ib = u8(buffers[meta.buf + 1]);
    const i32 = new Int32Array(ib.byteLength / 4);
    new Uint8Array(i32.buffer).set(ib);
    const i8 = new Int8Array(u8(buffers[meta.buf + 2]).slice().buffer);
    const nodes = [];
    for (let i = 0; i < n; i++) {
      nodes.push({ x0: f[i], value: f[n + i], parent: i32[i], blocks: i32[n + i],
        name: this.strings[i32[2 * n + i]] || "", text: this.strings[i32[3 * n + i]] || "",
        depth: i8[i], kind: i8[n + i] });
    }
    const was = this.holders;
    this.holders = { meta, nodes };
    this.dirty.add("holders");
    // the moment's mark on the timeline comes and goes with it
    if (!was || (was.meta.at !== meta.at)) this.dirty.add("timeline");
  }

  schedule() {
    if (this.frame || this.closed || !this.visible) return;
    this.frame = requestAnimationFrame(() => { this.frame = 0; this.draw(); });
  }

  // ------------------------------------------------------------ drawing, on animation frames
  // What changed is drawn in a fixed order, a few milliseconds' worth per frame: a plot that
  // takes long (the heatmap) never holds the page for all four, and a dashboard scrolled out
  // of view draws nothing until it is back (it keeps taking in data).
  draw() {
    if (!this.visible) return;
    const t0 = performance.now();
    const order = [["head", () => this.drawHead()],
      ["timeline", () => this.drawTimeline()], ["heatmap", () => this.drawHeatmap()],
      ["chunkmap", () => this.drawChunks()], ["bins", () => this.drawBins()],
      ["holders", () => this.drawHolders()]];
    for (const [name, fn] of order) {
      if (!this.dirty.has(name)) continue;
      if (name !== "head" && !this.cells[name]) { this.dirty.delete(name); continue; }
      if (name !== "head" && performance.now() - t0 > 8) break;  // the rest next frame
      this.dirty.delete(name);
      const t = performance.now();
      fn();
      this.stats.ms[name] = performance.now() - t;
    }
    this.stats.draws++;
    this.stats.drawMs = performance.now() - t0;
    this.root.dataset.draws = String(this.stats.draws);
    if (this.dirty.size) this.schedule();
  }

  xRange() {
    const a = this.tl.t.length ? this.tl.t[0] : 0;
    const b = this.heat.t.length ? this.heat.t[0] : a;
    const lo = Math.min(a, b);
    return [lo, Math.max(this.now || 0, lo + 1)];
  }

  layout(extra) {
    return Object.assign({
      margin: { l: 64, r: 10, t: 8, b: 36 }, height: 260, autosize: true,
      font: { family: "system-ui, sans-serif", size: 11 }, showlegend: false,
      plot_bgcolor: "white", paper_bgcolor: "white", uirevision: "gpudash",
    }, extra);
  }

  // A layout with a legend: one row above the plot area, at the left (the colours of
  // gpudash.style, named as in the report and the what-if view).
  legendLayout(extra) {
    return this.layout(Object.assign({
      showlegend: true, margin: { l: 64, r: 10, t: 26, b: 36 },
      // at the left: plotly's mode bar takes the top right corner when the mouse is over
      legend: { orientation: "h", x: 0, xanchor: "left", y: 1, yanchor: "bottom", traceorder: "normal",
        font: { size: 10 }, itemclick: false, itemdoubleclick: false,
        bgcolor: "rgba(255,255,255,0)" },
    }, extra));
  }

  plot(name, traces, layout) {
    const cell = this.cells[name];
    const config = { displaylogo: false, responsive: true, displayModeBar: "hover",
      // a short mode bar (zoom, pan, in, out, reset; a double-click autoscales): it stays
      // clear of the legend at the plot's left
      modeBarButtonsToRemove: ["select2d", "lasso2d", "toImage", "autoScale2d",
        "hoverClosestCartesian", "hoverCompareCartesian", "toggleSpikelines"] };
    this.Plotly.react(cell.plot, traces, layout, config);
    cell.drawn = true;
    cell.plot.dataset.drawn = "1";
  }

  none(name, text) {
    const cell = this.cells[name];
    cell.plot.style.display = "none";
    cell.none.style.display = "";
    cell.none.textContent = text;
    cell.drawn = true;
    cell.plot.dataset.drawn = "1";
  }

  drawHead() {
    const h = this.headline;
    if (!h) return;
    const w = this.words || {};
    const inUse = w.in_use || "in use", pool = w.pool || "pool";
    const over = h.in_use > h.limit && h.limit > 0;
    const miss = new Set(h.missing || []);
    const known = (k) => !miss.has(k);
    const items = [`<b>${esc(h.name)}</b>`, `${esc(inUse)} <b>${fmtBytes(h.in_use)}</b>`];
    if (known("pool_bytes")) items.push(`${esc(pool)} <b>${fmtBytes(h.pool)}</b>`);
    if (known("bytes_limit")) items.push(`limit <b>${h.limit ? fmtBytes(h.limit) : "-"}</b>`);
    if (known("peak_bytes_in_use")) items.push(`${esc(w.peak || "peak")} ${fmtBytes(h.peak)}`);
    if (known("largest_free_block_bytes")) items.push(`largest free ${fmtBytes(h.largest_free)}`);
    // the model's fragmentation figure: TensorFlow's 1 - largest free / free; PyTorch's
    // reserved but unallocated (bytes and % of reserved)
    const f = h.frag || { label: "fragmentation", text: (100 * h.fragmentation).toFixed(1) + " %", meaning: "" };
    if (known("fragmentation") && known("largest_free_block_bytes") && known("pool_bytes"))
      items.push(`<span title="${esc(f.meaning)}" data-head="frag">${esc(f.label)} ${esc(f.text)}</span>`);
    if (this.hasLayout) items.push(`${esc(w.chunk || "chunk")}s ${h.chunks}`);
    // the model's own figures, by its names (PyTorch's segments, num_alloc_retries...)
    for (const [label, value] of (h.extra || [])) items.push(`${esc(label)} <b>${esc(value)}</b>`);
    items.push(`OOMs ${h.counters.ooms || 0}`);
    if (h.note) items.push(`<span class="gd-note" data-head="note">${esc(h.note)}</span>`);
    if (miss.size) items.push(`<span class="gd-note">not reported by this source: ${
      esc([...miss].map((k) => k.replace(/_/g, " ")).join(", "))}</span>`);
    if (over) items.push('<span class="gd-over">OVER LIMIT</span>');
    this.head.innerHTML = items.map((x) => `<span>${x}</span>`).join("");
    // a watched framework that is not answering (or failed): said in the status line
    if (h.error) {
      this.status.textContent = h.error;
      this.status.classList.add("err");
      this.sourceError = true;
    } else if (this.sourceError) {
      this.status.textContent = "";
      this.status.classList.remove("err");
      this.sourceError = false;
    }
    // a pool above a limit lowered live: what happens to it, in the model's words
    if (h.banner) {
      this.banner.style.display = "";
      this.banner.textContent = h.banner;
    } else {
      this.banner.style.display = "none";
    }
    const t = this.cells.timeline;
    if (t) t.title.textContent = `memory over time - ${inUse} ${fmtBytes(h.in_use)}` +
      (known("pool_bytes") ? `, ${pool} ${fmtBytes(h.pool)}` : "") +
      (known("bytes_limit") ? `, limit ${h.limit ? fmtBytes(h.limit) : "-"}` : "");
  }

  drawTimeline() {
    const tl = this.tl;
    const C = this.C;
    let top = 1;
    for (const k of ["used", "pool", "limit"]) for (const v of tl[k]) if (v > top) top = v;
    const u = unitFor(top);
    const sc = (a) => a.map((v) => v / u.scale);
    const x = tl.t.slice();
    const now = this.now || 0;
    const ext = (a) => a.length ? a.concat([a[a.length - 1]]) : a;  // lines reach the present
    const xs = x.length ? x.concat([now]) : x;
    const hov = `%{y:.2f} ${u.name} at %{x:.1f} s`;
    const w = this.words || {};
    const inUse = w.in_use || "in use", pool = w.pool || "pool";
    const traces = [
      { type: "scatter", mode: "lines", name: inUse, x: xs, y: ext(sc(tl.used)),
        line: { color: C["in use"], width: 2, shape: "hv" }, fill: "tozeroy", fillcolor: this.setup.fills["in use"],
        hovertemplate: inUse + " " + hov + "<extra></extra>" },
      { type: "scatter", mode: "lines", name: pool, x: xs, y: ext(sc(tl.pool)),
        line: { color: C.pool, width: 1.5, shape: "hv" }, hovertemplate: pool + " " + hov + "<extra></extra>" },
      { type: "scatter", mode: "lines", name: "limit", x: xs, y: ext(sc(tl.limit)),
        line: { color: C.limit, width: 1.5, dash: "dash", shape: "hv" }, hovertemplate: "limit " + hov + "<extra></extra>" },
    ];
    const miss = new Set((this.headline && this.headline.missing) || []);
    if (miss.has("bytes_limit")) traces.splice(2, 1);
    if (miss.has("pool_bytes")) traces.splice(1, 1);
    const ooms = (this.headline && this.headline.ooms) || [];
    if (ooms.length) traces.push({ type: "scatter", mode: "markers", name: "OOM",
      x: ooms.map((o) => o[0]), y: ooms.map((o) => o[2] / u.scale),
      marker: { color: C.oom, symbol: "x", size: 10 },
      customdata: ooms.map((o) => fmtBytes(o[1])),
      hovertemplate: "out of memory: %{customdata} at %{x:.1f} s<extra></extra>" });
    // the moment the holders view shows, when one was picked here
    const at = this.holders && !this.holders.meta.live ? this.holders.meta.at : null;
    const shapes = at == null ? [] : [{ type: "line", x0: at, x1: at, yref: "paper", y0: 0, y1: 1,
      line: { color: C["over limit"], width: 2, dash: "dot" } }];
    this.plot("timeline", traces, this.legendLayout({
      xaxis: { title: { text: this.setup.time_title }, range: this.xRange(), gridcolor: C.grid },
      yaxis: { title: { text: "bytes" }, ticksuffix: " " + u.name, rangemode: "tozero", gridcolor: C.grid },
      shapes,
    }));
    if (this.cells.holders) this.watchTimeline(this.cells.timeline);
  }

  // Once per plot: a click on the timeline (on a line or anywhere in its plot area) asks the
  // kernel for the holders at that moment (seconds since the model started, as the x axis).
  watchTimeline(cell) {
    if (!cell || cell.clickWatched || !cell.plot.on) return;
    cell.clickWatched = true;
    let last = 0;
    const pick = (x) => {
      if (!isFinite(x)) return;
      const now = performance.now();
      if (now - last < 250) return;  // plotly's click and the page's click of one press
      last = now;
      this.act("holders_at", x);
    };
    cell.plot.on("plotly_click", (ev) => {
      const p = ev && ev.points && ev.points[0];
      if (p) pick(Number(p.x));
    });
    // a click away from the lines: the x under the mouse, from the axis
    cell.plot.addEventListener("click", (ev) => {
      const L = cell.plot._fullLayout;
      const xa = L && L.xaxis;
      if (!xa || typeof xa.p2d !== "function") return;
      const box = cell.plot.getBoundingClientRect();
      const px = ev.clientX - box.left - xa._offset;
      const py = ev.clientY - box.top - L.yaxis._offset;
      if (px < 0 || px > xa._length || py < 0 || py > L.yaxis._length) return;
      pick(Number(xa.p2d(px)));
    });
  }

  drawHeatmap() {
    if (!this.hasLayout) return this.none("heatmap", "this source reports totals only: no address layout to draw");
    const H = this.heat;
    const ncol = H.cols.length;
    // rows cover the device; draw only up to the largest pool seen (the rest is never used)
    let pool = (this.headline && this.headline.pool) || 0;
    for (const v of this.tl.pool) if (v > pool) pool = v;
    const rb = H.rowBytes || 1;
    const rows = Math.max(1, Math.min(H.rows || 0, Math.ceil((pool * 1.02) / rb)));
    const top = rows * rb;
    const u = unitFor(top);
    const z = new Array(rows);
    for (let r = 0; r < rows; r++) {
      const row = new Float32Array(ncol);
      for (let j = 0; j < ncol; j++) row[j] = H.cols[j][r] / 2.55;
      z[r] = row;
    }
    const y = new Float64Array(rows);
    for (let r = 0; r < rows; r++) y[r] = ((r + 0.5) * H.rowBytes) / u.scale;
    // column j holds the state from its sample time until the next column's: pass cell
    // edges (ncol + 1 of them), not centres, so nothing is painted before it happened
    const edges = new Float64Array(ncol + 1);
    for (let j = 0; j < ncol; j++) edges[j] = H.t[j];
    if (ncol) edges[ncol] = Math.max(this.now || 0, H.t[ncol - 1] + 1e-3);
    this.plot("heatmap", [{ type: "heatmap", x: edges, y, z, zmin: 0, zmax: 100,
      colorscale: this.setup.heatmap_scale, colorbar: { title: { text: "% in use" }, thickness: 10 },
      hovertemplate: `%{x:.1f} s, offset %{y:.2f} ${u.name}: %{z:.0f} % in use<extra></extra>` }],
    this.layout({
      xaxis: { title: { text: this.setup.time_title }, range: this.xRange() },
      yaxis: { title: { text: "address offset" }, ticksuffix: " " + u.name, range: [0, top / u.scale] },
      margin: { l: 64, r: 10, t: 26, b: 36 },  // level with the plots that have legends
    }));
  }

  // The segment / chunk map: regions as rows of one width in bytes (meta.row_bytes), a
  // region larger than a row continuing on the next rows (gpudash.maplayout.row_layout).
  // Rows are the categories of the y axis, named by their region, so plotly thins the tick
  // labels by the space per row (nticks), and the hover says which row a block is in. A map
  // of many rows opens on its first rows, ROW_PX pixels each, in a plot of at most MAP_MAX_PX.
  drawChunks() {
    if (!this.hasLayout) return this.none("chunkmap", "this source reports totals only: no chunk layout to draw");
    const ch = this.chunks;
    const m = ch.meta;
    const n = m.n;
    const c = ch.cols;
    const kindNames = m.kind_names || [];  // PyTorch: a segment's pool, expandable or not
    const w = this.words || {};
    const inUse = w.in_use || "in use";
    const region = w.region || "region";
    const R = m.n_regions;
    const reg = ch.regions;
    const W = Math.max(1, m.row_bytes || 1);
    const nRows = Math.max(0, m.n_rows || 0);
    const u = unitFor(W);
    // each row by its region's address and size (and, for PyTorch, its pool): two regions of
    // one size stay apart; a continuation row by the region's address and the offset it
    // starts at
    // a region takes ceil(size / W) rows: those of one row first, then the others, each in
    // address order (gpudash.maplayout.RowLayout)
    const names = new Array(nRows);
    const first = new Float64Array(R);
    let fr = 0;
    for (const wraps of [false, true]) {
      for (let r = 0; r < R; r++) {
        const size = reg[R + r];
        const k = Math.max(1, Math.ceil(size / W));
        if ((k > 1) !== wraps) continue;
        first[r] = fr;
        const kind = kindNames[ch.kinds[r]];
        names[fr] = regionLabel([reg[r], size]) + (kind ? " " + kind : "");
        const at = "0x" + Number(reg[r]).toString(16) + " +";
        for (let j = 1; j < k && fr + j < nRows; j++) names[fr + j] = at + fmtShort(j * W);
        fr += k;
      }
    }
    const cell = this.cells.chunkmap;
    const margin = { l: 64, r: 10, t: 26, b: 36 };
    const height = Math.max(260, Math.min(MAP_MAX_PX, margin.t + margin.b + 10 + ROW_PX * nRows));
    const plotPx = height - margin.t - margin.b;
    const shown = Math.max(1, Math.min(nRows, Math.floor(plotPx / ROW_PX)));
    // The rows drawn: those in view and as many again on either side (a drag of up to a
    // screen shows drawn rows; panning or zooming further draws the rows then in view, see
    // watchMap). A map of 1,000 rows then draws a hundred of them, not every block.
    const view = this.mapView(cell, shown, nRows);
    const span = view[1] - view[0];
    const lo = Math.max(0, view[0] - span), hi = Math.min(nRows, view[1] + span);
    this.mapDrawn = [lo, hi];
    const T = { used: { y: [], b: [], x: [], h: [] }, waste: { y: [], b: [], x: [], h: [] },
      free: { y: [], b: [], x: [], h: [] } };
    // a part [a0, a0 + len) of region ri, cut at row boundaries, the rows drawn only
    const put = (t, ri, a0, len, hv) => {
      const fr = first[ri];
      let a = a0;
      const end = a0 + len;
      while (a < end) {
        const row = Math.floor(a / W);
        const b = Math.min(end, (row + 1) * W);
        if (fr + row >= lo && fr + row < hi) {
          t.y.push(names[fr + row]); t.b.push((a - row * W) / u.scale); t.x.push((b - a) / u.scale); t.h.push(hv);
        }
        a = b;
      }
    };
    const strings = this.strings || [];
    const ids = ch.holders;
    for (let i = 0; i < n; i++) {
      const ri = c[i], off = c[n + i], size = c[2 * n + i];
      const r0 = first[ri] + Math.floor(off / W), r1 = first[ri] + Math.floor((off + Math.max(size, 1) - 1) / W);
      if (r1 < lo || r0 >= hi) continue;  // not in a row drawn
      const req = c[3 * n + i], used = c[4 * n + i], ptr = c[5 * n + i];
      const row = names[first[ri]] || "";
      const addr = "0x" + ptr.toString(16);
      const hid = ids && ids.length ? ids[i] : -1;
      const held = hid >= 0 && strings[hid] ? strings[hid] : "";
      const who = held ? "<br>held by:<br>&nbsp;&nbsp;" + held.split("\n").map(esc).join("<br>&nbsp;&nbsp;") : "";
      if (used) {
        const hv = `${esc(row)}<br>${addr}<br>size ${fmtBytes(size)}<br>requested ${fmtBytes(req)}${who}`;
        put(T.used, ri, off, req, hv);
        if (size > req) put(T.waste, ri, off + req, size - req, `${esc(row)}<br>${addr}<br>waste ${fmtBytes(size - req)} of ${fmtBytes(size)}`);
      } else {
        put(T.free, ri, off, size, `${esc(row)}<br>${addr}<br>free ${fmtBytes(size)}`);
      }
    }
    const C = this.C;
    // a white edge between blocks, unless the rows are many (zoomed out, it would be all edge)
    const edge = shown < nRows ? 0 : 0.5;
    const mk = (t, name, color) => ({ type: "bar", orientation: "h", name, y: t.y, base: t.b, x: t.x,
      marker: { color, line: { width: edge, color: "white" } }, hovertext: t.h, hoverinfo: "text", width: 0.8,
      showlegend: true });
    const traces = [mk(T.used, inUse, C["in use"]), mk(T.waste, "waste", C.waste), mk(T.free, "free", C.free)];
    let title = `${w.map || "chunk map"} - ${n} ${w.chunk || "chunk"}s in ${R} ${region}(s)`;
    if (nRows > R) title += ` - rows of ${fmtShort(W)}, a longer ${region} after the others`;
    if (shown < nRows) title += ` - rows 1-${shown} of ${nRows}: drag to pan, double-click for all`;
    cell.title.textContent = title;
    cell.title.title = title;
    if (cell.plot.style.height !== height + "px") cell.plot.style.height = height + "px";
    this.plot("chunkmap", traces,
      this.legendLayout({ barmode: "overlay", bargap: 0.1, height, margin,
        dragmode: shown < nRows ? "pan" : "zoom",
        xaxis: { title: { text: "offset in " + region }, ticksuffix: " " + u.name, range: [0, W / u.scale] },
        // no axis title: the rows' names say what they are (a title would sit on them)
        yaxis: { automargin: true, type: "category", categoryorder: "array",
          categoryarray: names, range: [shown - 0.5, -0.5], nticks: Math.max(2, Math.floor(plotPx / ROW_PX)),
          // a double-click ("autosize") shows every row, not only those drawn
          autorangeoptions: { include: nRows ? [0, nRows - 1] : [] },
          tickfont: { size: 10 } } }));
    this.watchMap(cell);
    cell.plot.dataset.rows = String(nRows);
    cell.plot.dataset.shown = String(shown);
  }

  // The rows in view, [first, last + 1): the plot's y range as the user left it (pan, zoom,
  // double-click), else the first `shown` rows.
  mapView(cell, shown, nRows) {
    const L = cell.plot._fullLayout;
    const r = L && L.yaxis && L.yaxis.range;
    if (!cell.drawn || !r || this.mapRows !== nRows) {
      this.mapRows = nRows;
      return [0, Math.min(shown, nRows)];
    }
    const a = Math.max(0, Math.floor(Math.min(r[0], r[1]) + 0.5));
    const b = Math.min(nRows, Math.ceil(Math.max(r[0], r[1]) + 0.5));
    return [a, Math.max(a + 1, b)];
  }

  // Once per plot: when a pan or zoom brings rows into view that were not drawn, draw again.
  watchMap(cell) {
    if (cell.watched || !cell.plot.on) return;
    cell.watched = true;
    cell.plot.on("plotly_relayout", () => {
      const d = this.mapDrawn;
      if (!d || !this.chunks) return;
      const v = this.mapView(cell, 1, this.mapRows);
      if (v[0] < d[0] || v[1] > d[1]) { this.dirty.add("chunkmap"); this.schedule(); }
    });
  }

  drawBins() {
    if (!this.hasLayout) return this.none("bins", "this source reports totals only: no bins to draw");
    const b = this.chunks.bins;
    const k = this.chunks.meta.n_bins || 21;  // TensorFlow's 21 bins, PyTorch's 2 pools
    const labels = this.binLabels || this.setup.bin_labels;
    const w = this.words || {};
    const inUse = w.in_use || "in use", piece = w.chunk || "chunk";
    this.cells.bins.title.textContent = w.bins || "bins";
    let top = 1;
    for (let i = 0; i < k; i++) top = Math.max(top, b[i] + b[k + i]);
    const u = unitFor(top);
    const C = this.C;
    const col = (o) => Array.from(b.subarray(o * k, (o + 1) * k));
    const free = col(0), used = col(1), fc = col(2), uc = col(3);
    this.plot("bins", [
      { type: "bar", name: inUse, x: labels, y: used.map((v) => v / u.scale), marker: { color: C["in use"] },
        customdata: uc.map((n, i) => `${n} ${piece}(s), ${fmtBytes(used[i])}`), hovertemplate: inUse + ": %{customdata}<extra>%{x}</extra>" },
      { type: "bar", name: "free", x: labels, y: free.map((v) => v / u.scale), marker: { color: C.free },
        customdata: fc.map((n, i) => `${n} ${piece}(s), ${fmtBytes(free[i])}`), hovertemplate: "free: %{customdata}<extra>%{x}</extra>" },
    ], this.legendLayout({ barmode: "stack", xaxis: { title: { text: w.bins_axis || "bin (chunk size)", standoff: 4 }, type: "category", automargin: true },
      yaxis: { title: { text: "bytes" }, ticksuffix: " " + u.name },
      // a few bars (PyTorch's two pools): each says its figures, so a small one still reads
      annotations: k > 4 ? [] : labels.map((x, i) => ({ x, y: (used[i] + free[i]) / u.scale,
        text: `${fmtBytes(used[i])} ${inUse}, ${fmtBytes(free[i])} free`, showarrow: false,
        yanchor: "bottom", font: { size: 10, color: "#444" } })) }));
  }

  // The holders view: a flame graph (an icicle) of who holds the blocks in use, the root on
  // top, each node a bar as wide as its bytes under its parent; horizontal bars with a base
  // (plotly's cartesian bundle has no icicle trace).
  drawHolders() {
    const cell = this.cells.holders;
    const H = this.holders;
    if (!cell) return;
    const w = this.words || {};
    const inUse = w.in_use || "in use", piece = w.chunk || "chunk";
    if (!H) {
      cell.label.textContent = "who holds the memory";
      return;
    }
    const m = H.meta;
    const nodes = H.nodes;
    const C = this.C;
    const total = m.total || 0;
    const u = unitFor(Math.max(1, total));
    // the part of each node its children drawn do not cover: allocated at that frame
    // itself, or in smaller nodes left out
    const kids = new Float64Array(nodes.length);
    const hasKids = new Uint8Array(nodes.length);
    for (const nd of nodes) if (nd.parent >= 0) { kids[nd.parent] += nd.value; hasKids[nd.parent] = 1; }
    const kinds = [
      ["all", "#c7c7c7", "#222"], ["label", C["over limit"], "#fff"],
      ["your code", C["in use"], "#fff"], ["libraries, C++", C.marker, "#fff"],
      ["no frame of your code", C.waste, "#222"]];
    const T = kinds.map(() => ({ y: [], base: [], x: [], text: [], h: [] }));
    let depth = 0;
    nodes.forEach((nd, i) => {
      const t = T[Math.min(nd.kind, kinds.length - 1)];
      const pct = total ? (100 * nd.value / total).toFixed(1) : "0.0";
      const rest = nd.value - kids[i];
      let hv = `<b>${esc(nd.name)}</b>`;
      if (nd.text && nd.text !== nd.name) hv += "<br>" + esc(nd.text);
      hv += `<br>${fmtBytes(nd.value)} ${esc(inUse)} (${pct} %) in ${nd.blocks} ${esc(piece)}(s)`;
      if (hasKids[i] && rest > 0.5) hv += `<br>${fmtBytes(rest)} not under the frames drawn below ` +
        "(allocated here, or in smaller nodes left out)";
      t.y.push(nd.depth); t.base.push(nd.x0 / u.scale); t.x.push(nd.value / u.scale);
      t.text.push(i === 0 ? m.root : nd.name); t.h.push(hv);
      if (nd.depth > depth) depth = nd.depth;
    });
    const traces = T.map((t, k) => ({ type: "bar", orientation: "h", name: kinds[k][0], y: t.y,
      base: t.base, x: t.x, text: t.text, textposition: "inside", insidetextanchor: "start",
      textfont: { color: kinds[k][2], size: 11 }, width: 0.92, hovertext: t.h, hoverinfo: "text",
      marker: { color: kinds[k][1], line: { width: 1, color: "white" } },
      showlegend: t.y.length > 0 && k > 0 })).filter((t) => t.y.length);
    const rows = depth + 1;
    const margin = { l: 10, r: 10, t: 26, b: 36 };
    const height = Math.max(200, Math.min(MAP_MAX_PX, margin.t + margin.b + 26 * rows));
    if (cell.plot.style.height !== height + "px") cell.plot.style.height = height + "px";
    // the title: what is shown, and when
    cell.label.textContent = `who holds the memory - ${fmtBytes(total)} ${inUse} in ${m.blocks} ${piece}(s)`;
    if (m.live) {
      cell.moment.style.display = "none";
      cell.live.style.display = "none";
      cell.hint.style.display = "";
    } else {
      cell.moment.style.display = "";
      cell.moment.textContent = `at ${Number(m.at).toFixed(2)} s`;
      cell.live.style.display = "";
      cell.hint.style.display = "none";
    }
    cell.title.title = [m.rule].concat(m.notes || []).filter((x) => x).join("\n");
    cell.plot.dataset.total = String(total);
    cell.plot.dataset.live = m.live ? "1" : "0";
    cell.plot.dataset.at = m.at == null ? "" : String(m.at);
    this.plot("holders", traces, this.legendLayout({ barmode: "overlay", height, margin,
      uniformtext: { mode: "hide", minsize: 9 },
      xaxis: { title: { text: "bytes " + inUse }, ticksuffix: " " + u.name,
        range: [0, Math.max(total, 1) / u.scale], gridcolor: C.grid, zeroline: false },
      yaxis: { autorange: "reversed", showticklabels: false, zeroline: false, showgrid: false,
        fixedrange: true },
      annotations: total ? [] : [{ text: `nothing ${esc(inUse)} at this moment`, x: 0.5, y: 0.5,
        xref: "paper", yref: "paper", showarrow: false, font: { color: "#777" } }] }));
  }

  close() {
    this.closed = true;
    if (this.frame) cancelAnimationFrame(this.frame);
    if (this.observer) this.observer.disconnect();
    for (const c of Object.values(this.cells)) { try { this.Plotly.purge(c.plot); } catch (e) { /* gone */ } }
    G.views = G.views.filter((v) => v !== this);
  }
}

async function render({ model, el: root }) {
  const wait = root.appendChild(el("div", { class: "gd-status" }, "gpudash: loading the views..."));
  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (err) {
    wait.textContent = "gpudash: could not load plotly.js: " + err;
    return () => {};
  }
  wait.remove();
  const view = new View(model, root, Plotly);
  G.views.push(view);
  const onMsg = (msg, buffers) => view.onMessage(msg, buffers || []);
  model.on("msg:custom", onMsg);
  model.send({ type: "hello" });
  return () => { model.off("msg:custom", onMsg); view.close(); };
}

export default { render };
