/* kvmap's replay report: draws the figures from the run data embedded in the page (#kvmap-data), with uPlot.
   Rules: every number drawn is read from that data (the same run data as `kvmap replay --json`); nothing is
   fetched. Each figure's element gets data-points (how many values it drew) once drawn; the body gets
   data-render-ms when every figure is drawn, and data-errors if anything failed. */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("kvmap-data").textContent);
  const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                  "#9c755f", "#bab0ac", "#1f77b4", "#8c564b"];
  const WIDTH = Math.min(1100, document.body.clientWidth - 40);
  const t0 = performance.now();
  const fmt = (v, k) => v == null ? "-" : (Math.abs(v) >= 100 || Number.isInteger(v) ? v.toFixed(0) : v.toFixed(k ?? 1));
  const pct = v => v == null ? "-" : (100 * v).toFixed(1) + "%";

  function mount(id, opts, data) {
    const el = document.querySelector(`[data-fig="${id}"] .plot`);
    if (!el) return null;
    opts.width = WIDTH;
    opts.height = opts.height || 320;
    const u = new uPlot(opts, data, el);
    let n = 0;
    for (let i = 1; i < data.length; i++) n += data[i].filter(v => v != null).length;
    el.parentElement.dataset.points = String(n);
    return u;
  }

  function markSteps(u, steps, ys, color) {  // slow steps: rings over their stacked totals
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = color;
    ctx.lineWidth = 2 * devicePixelRatio;
    steps.forEach((s, i) => {
      const x = u.valToPos(s, "x", true), y = u.valToPos(Math.min(ys[i], u.scales.y.max), "y", true);
      ctx.beginPath();
      ctx.arc(x, y, 5 * devicePixelRatio, 0, 2 * Math.PI);
      ctx.stroke();
    });
    ctx.restore();
  }

  function shadeWarmup(u, warm) {  // warm-up steps: a grey band; the measured window starts after it
    if (!warm.length) return;
    const ctx = u.ctx, top = u.bbox.top, h = u.bbox.height;
    const a = u.valToPos(warm[0] - 0.5, "x", true), b = u.valToPos(warm[warm.length - 1] + 0.5, "x", true);
    ctx.save();
    ctx.fillStyle = "rgba(120,120,120,0.18)";
    ctx.fillRect(a, top, Math.max(b - a, 2), h);
    ctx.restore();
  }

  function timeFigure() {  // time per step, stacked by phase: drawn top down, each filled to zero
    const T = D.time, phases = D.phases;
    const cum = [];
    let acc = T.x.map(() => 0);
    phases.forEach(p => { acc = acc.map((a, i) => a + T.us[p][i]); cum.push(acc); });
    const order = phases.map((p, i) => i).reverse();
    const series = [{label: "step"}];
    const data = [T.x];
    order.forEach(i => {
      const raw = T.us[phases[i]];
      series.push({label: phases[i], stroke: COLORS[i % COLORS.length], fill: COLORS[i % COLORS.length] + "cc",
                   width: 0.5, points: {show: false}, value: (u, v, si, idx) => idx == null ? "-" : fmt(raw[idx]) + " us"});
      data.push(cum[i]);
    });
    const slowY = D.slow.steps.map(s => { const i = T.x.indexOf(s); return i < 0 ? 0 : cum[cum.length - 1][i]; });
    const top = cum[cum.length - 1] || [];
    const sorted = top.slice().sort((a, b) => a - b);
    const p99 = sorted.length ? sorted[Math.floor(0.99 * (sorted.length - 1))] : 0;
    const u = mount("time", {title: "time per step, stacked by phase (us)" + (D.downsampled ? ", min/max envelope" : ""),
                   scales: {x: {time: false}}, series: series,
                   axes: [{label: "step"}, {label: "us", size: 60}],
                   hooks: {drawClear: [u => shadeWarmup(u, D.warmup_steps)],
                           draw: [u => markSteps(u, D.slow.steps, slowY, "#d62728")]}}, data);
    const clip = document.querySelector('[data-fig="time"] input.clip');
    if (u && clip) clip.addEventListener("change", () => {  // the bulk of the steps, outliers ringed at the top
      u.setScale("y", {min: 0, max: clip.checked ? 1.5 * p99 : Math.max(...top) * 1.05});
    });
  }

  function scatterFigure(id, xkey, xlabel, slopeKey, fixedKey) {  // step time against batch size, with the fit
    const S = D.scatter, names = Object.keys(S.us);
    const sel = document.querySelector(`[data-fig="${id}"] select`);
    names.forEach(n => { const o = document.createElement("option"); o.value = o.textContent = n; sel.appendChild(o); });
    sel.value = "step";
    let plot = null;
    function build(name) {
      const xs = S[xkey], ys = S.us[name];
      const idx = xs.map((v, i) => i).sort((a, b) => xs[a] - xs[b]);
      const x = idx.map(i => xs[i]), y = idx.map(i => ys[i]);
      const c = D.cost.phases[name];
      const fit = x.map(v => c[fixedKey] + c[slopeKey] * v);
      return [x, y, fit];
    }
    function draw(name) {
      const c = D.cost.phases[name];
      const data = build(name);
      const el = document.querySelector(`[data-fig="${id}"] .plot`);
      el.innerHTML = "";
      plot = new uPlot({width: WIDTH, height: 320, scales: {x: {time: false}},
        title: `${name}: ${fmt(c[fixedKey], 2)} us + ${fmt(c[slopeKey], 3)} us per ${xlabel}`,
        axes: [{label: "scheduled " + xlabel + "s"}, {label: "us", size: 60}],
        series: [{label: xlabel + "s"}, {label: name, stroke: COLORS[0], paths: () => null,
                                         points: {show: true, size: 4, fill: COLORS[0]}},
                 {label: "fit", stroke: COLORS[2], width: 2, points: {show: false}}]}, data, el);
      el.parentElement.dataset.points = String(data[1].length);
    }
    sel.addEventListener("change", () => draw(sel.value));
    draw("step");
    return plot;
  }

  function mixFigure() {  // batch composition: tokens by kind (left), requests and events (right)
    const M = D.mix;
    if (!M) return;
    const tok = ["prefill_tokens", "decode_tokens", "draft_tokens"], ev = ["requests", "new", "resumed",
                                                                          "preempted", "finished"];
    const series = [{label: "step"}], data = [M.x];
    tok.forEach((k, i) => { series.push({label: k, stroke: COLORS[i], width: 1, scale: "tok", points: {show: false}});
                            data.push(M.series[k]); });
    ev.forEach((k, i) => { series.push({label: k, stroke: COLORS[4 + i], width: 1, scale: "req", dash: i ? [4, 3] : undefined,
                                        points: {show: false}}); data.push(M.series[k]); });
    mount("mix", {title: "batch composition per step", scales: {x: {time: false}}, series: series,
                  axes: [{label: "step"}, {scale: "tok", label: "tokens", size: 60},
                         {scale: "req", side: 1, label: "requests", grid: {show: false}}]}, data);
  }

  function kvFigures() {  // KV cache: blocks per group, then memory efficiency beside contiguous allocation
    const K = D.kv;
    if (!K) return;
    const series = [{label: "step"}], data = [K.x];
    let c = 0;
    K.groups.forEach(g => {
      [["in_use", "blocks in use"], ["shared", "shared (prefix-cached)"]].forEach(([k, name]) => {
        series.push({label: `g${g.group} ${name}`, stroke: COLORS[c++ % COLORS.length], points: {show: false}});
        data.push(K.series[`g${g.group}.${k}`]);
      });
    });
    series.push({label: "free blocks (pool)", stroke: "#555", dash: [5, 4], points: {show: false}});
    data.push(K.series.free);
    mount("kv-blocks", {title: `KV cache blocks per step (pool of ${K.num_gpu_blocks} per rank)`,
                        scales: {x: {time: false}}, series: series,
                        axes: [{label: "step"}, {label: "blocks", size: 60}]}, data);
    const es = [{label: "step"}], ed = [K.x];
    c = 0;
    Object.keys(K.series).filter(k => k.startsWith("eff.")).forEach(k => {
      const name = k.slice(4);
      const contiguous = name.startsWith("contiguous");
      es.push({label: name.replace("contiguous_max_len", "contiguous, max_model_len each")
                          .replace("contiguous_final", "contiguous, final length each").replace(/^g(\d+)$/, "paged g$1"),
               stroke: contiguous ? (name.endsWith("final") ? "#8c564b" : "#7f7f7f") : COLORS[c++ % COLORS.length],
               dash: contiguous ? [6, 4] : undefined, points: {show: false}, value: (u, v) => pct(v)});
      ed.push(K.series[k].map(v => v == null ? null : v));
    });
    mount("kv-eff", {title: "memory efficiency: tokens held / memory reserved", scales: {x: {time: false},
                     y: {range: [0, 1.05]}}, series: es,
                     axes: [{label: "step"}, {label: "efficiency", size: 60, values: (u, vs) => vs.map(v => pct(v))}]}, ed);
  }

  try {
    timeFigure();
    scatterFigure("cost-tokens", "tokens", "token", "per_token_us", "fixed_us");
    scatterFigure("cost-reqs", "reqs", "request", "per_request_us", "fixed_us_by_reqs");
    mixFigure();
    kvFigures();
  } catch (e) {
    document.body.dataset.errors = String(e && e.stack || e);
    throw e;
  }
  document.body.dataset.renderMs = (performance.now() - t0).toFixed(1);
})();
