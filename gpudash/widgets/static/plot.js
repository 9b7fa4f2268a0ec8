// gpudash plot view (anywidget ES module, after loader.js): one plotly figure of the kernel.
// See gpudash/widgets/plot.py: plotly.js once per page, the whole figure on hello (a reloaded
// page draws it again) and after each change, drawn on the next animation frame.

const PLOT_CSS = `
.gd-plotview{width:100%;font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;font-size:12px}
.gd-plotview .gd-wait{color:#777;padding:4px}
.gd-plotview .gd-wait.err{color:#d62728}
`;

async function render({ model, el }) {
  el.classList.add("gd-plotview");
  const style = el.appendChild(document.createElement("style"));
  style.textContent = PLOT_CSS;
  const wait = el.appendChild(document.createElement("div"));
  wait.className = "gd-wait";
  wait.textContent = "gpudash: loading the plot...";
  wait.style.minHeight = model.get("height") + "px";
  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (err) {
    wait.textContent = "gpudash: could not load plotly.js: " + err;
    wait.classList.add("err");
    return () => {};
  }
  const div = el.appendChild(document.createElement("div"));
  let figure = null;
  let frame = 0;
  let closed = false;
  let width = 0;
  const config = { displaylogo: false, responsive: true, displayModeBar: "hover",
    modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  const draw = () => {
    frame = 0;
    if (closed || !figure) return;
    wait.remove();
    Plotly.react(div, figure.data || [], figure.layout || {}, config);
    width = div.clientWidth;
    div.dataset.drawn = String(Number(div.dataset.drawn || 0) + 1);
  };
  const onMsg = (msg) => {
    if (!msg) return;
    if (msg.type === "figure") {
      figure = JSON.parse(msg.json);
      if (!frame) frame = requestAnimationFrame(draw);
    } else if (msg.type === "error") {
      wait.textContent = "gpudash: " + msg.text;
      wait.classList.add("err");
    }
  };
  model.on("msg:custom", onMsg);
  // as wide as the box it is shown in, also when the box changes without a window resize
  // (a side panel opened or closed)
  const observer = new ResizeObserver(() => {
    if (figure && div.clientWidth && div.clientWidth !== width) {
      width = div.clientWidth;
      Plotly.Plots.resize(div);
    }
  });
  observer.observe(el);
  model.send({ type: "hello" });
  return () => {
    closed = true;
    model.off("msg:custom", onMsg);
    observer.disconnect();
    if (frame) cancelAnimationFrame(frame);
    try { Plotly.purge(div); } catch (e) { /* gone */ }
  };
}

export default { render };
