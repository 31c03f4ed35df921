// The live job page: polls api/state (the same origin, the token of this page's address if
// any) and redraws. No framework, no request elsewhere.
"use strict";
(function () {
  const token = new URLSearchParams(location.search).get("token");
  const api = "api/state" + (token ? "?token=" + encodeURIComponent(token) : "");
  document.getElementById("json-link").href = api;
  const COLORS = ["#2563eb", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2",
                  "#65a30d", "#dc2626"];
  let failures = 0;
  let last = null;

  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      // styles through the CSSOM: the page's Content-Security-Policy refuses style attributes
      if (k === "text") e.textContent = v;
      else if (k === "style") Object.assign(e.style, v);
      else e.setAttribute(k, v);
    }
    for (const c of children || []) e.appendChild(c);
    return e;
  }
  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "-";
    return Number(v).toFixed(digits === undefined ? 2 : digits);
  }
  function ms(v) { return v === null || v === undefined ? "-" : (v * 1000).toFixed(0) + " ms"; }
  function mb(v) { return v === null || v === undefined ? "-" : (v / 1e6).toFixed(1); }
  function duration(s) {
    if (s === null || s === undefined) return "-";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
  }
  function set(id, text) { document.getElementById(id).textContent = text; }

  function renderJob(s) {
    const j = s.job;
    set("job-phase", j.phase);
    set("job-workers", j.workers + " / " + j.expected_workers);
    set("job-servers", j.servers + " / " + j.expected_servers);
    set("job-step", j.total_steps ? j.progress_step + " / " + j.total_steps
                                  : (j.step === undefined || j.step === null ? "-" : j.step));
    set("job-steps-per-s", fmt(j.steps_per_s));
    set("job-samples-per-s", j.samples_per_s === undefined ? "-" : fmt(j.samples_per_s, 1));
    set("job-eta", j.eta_s === undefined ? "-" : duration(j.eta_s));
    set("job-uptime", duration(j.uptime_s));
    const banner = document.getElementById("straggler");
    if (s.straggler) {
      const st = s.straggler;
      banner.hidden = false;
      banner.textContent = "Straggler: worker rank " + st.ranks.join(", ") + " on " + st.host +
        " - the other workers wait for it " + (st.fraction * 100).toFixed(0) +
        "% of the job's time (last " + s.settings.window_s + " s)";
      banner.dataset.rank = String(st.rank);
    } else {
      banner.hidden = true;
      delete banner.dataset.rank;
    }
  }

  function splitBar(w) {
    const bar = el("div", {class: "bar"});
    if (w.step_time_s) {
      for (const part of ["compute", "wait", "exchange"]) {
        const v = w[part + "_s"] || 0;
        bar.appendChild(el("span", {class: part, style: {width:
          (100 * v / w.step_time_s).toFixed(1) + "%"}, title: part + " " + ms(v)}));
      }
    }
    const text = w.step_time_s ? ms(w.compute_s) + " | " + ms(w.wait_s) + " | " +
      ms(w.exchange_s) : "-";
    return el("td", {class: "split"}, [bar, el("div", {class: "muted", text: text})]);
  }

  function renderWorkers(s) {
    const body = document.querySelector("#workers tbody");
    body.replaceChildren(...s.workers.map(w => el("tr", {
      "data-rank": String(w.rank), "data-state": w.state,
      class: (w.straggler ? "straggler " : "") + w.state}, [
      el("td", {text: String(w.rank)}), el("td", {text: w.host}), el("td", {text: w.state}),
      el("td", {class: "step", text: w.step === null || w.step === undefined ? "-" : String(w.step)}),
      el("td", {class: "steps-per-s", text: fmt(w.steps_per_s)}),
      el("td", {text: ms(w.step_time_s)}), splitBar(w),
      el("td", {class: "held", text: (w.held_fraction * 100).toFixed(0) + "%"}),
      el("td", {text: mb(w.bytes_per_s)})])));
  }

  function renderServers(s) {
    const body = document.querySelector("#servers tbody");
    body.replaceChildren(...s.servers.map(v => el("tr", {
      "data-rank": String(v.rank), "data-state": v.state, class: v.state}, [
      el("td", {text: String(v.rank)}), el("td", {text: v.host}), el("td", {text: v.state}),
      el("td", {class: "bytes-per-s", text: mb(v.bytes_per_s)}),
      el("td", {text: v.keys === null || v.keys === undefined ? "-" : String(v.keys)}),
      el("td", {text: fmt(v.cpu_cores)}), el("td", {text: fmt(v.rounds_per_s, 1)}),
      el("td", {text: v.store_bytes === null || v.store_bytes === undefined ? "-" :
        mb(v.store_bytes) + " MB"}),
      el("td", {class: "owns", text: v.keys_owned === null || v.keys_owned === undefined ? "-" :
        v.keys_owned + " / " + mb(v.bytes_owned) + " MB"})])));
  }

  function renderFailovers(s) {
    const list = document.getElementById("failovers");
    const fos = s.failovers || [];
    list.replaceChildren(...(fos.length ? fos.map(f => el("li", {
      "data-cause": f.cause, "data-server": String(f.server)}, [
      el("span", {class: "muted", text: new Date(f.at * 1000).toLocaleTimeString() + " "}),
      el("span", {class: "kind", text: f.cause === "replacement" ? "replaced" : "lost: " + f.cause}),
      document.createTextNode("server " + f.server + " on " + (f.host || "?") + " (pid " + f.pid +
        "): " + (f.keys_moved === null ? "keys moved: ?" : f.keys_moved + " keys (" +
        mb(f.bytes_moved) + " MB) moved") + ", stall " +
        (f.stall === null ? "-" : fmt(f.stall) + " s") + ". " + f.why)])) :
      [el("li", {class: "muted", text: "none"})]));
  }

  function renderTimeline(s) {
    const svg = document.getElementById("timeline");
    const pts = s.timeline;
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    const ranks = new Set();
    let top = 0;
    for (const p of pts) {
      for (const [r, v] of Object.entries(p.steps_per_s)) {
        ranks.add(r);
        if (v !== null && v > top) top = v;
      }
    }
    if (pts.length < 2 || top <= 0) return;
    top *= 1.25;  // headroom: a line at the top is still seen
    const t0 = pts[0].time, t1 = pts[pts.length - 1].time, W = 900, H = 160;
    const x = t => (t1 > t0 ? (t - t0) / (t1 - t0) : 0) * W;
    const y = v => H - 8 - (v / top) * (H - 16);
    pts.forEach((p, i) => {
      if (p.straggler !== null && i + 1 < pts.length) {
        const r = document.createElementNS(ns, "rect");
        r.setAttribute("x", x(p.time)); r.setAttribute("y", 0);
        r.setAttribute("width", Math.max(1, x(pts[i + 1].time) - x(p.time)));
        r.setAttribute("height", H); r.setAttribute("fill", "#fecaca");
        svg.appendChild(r);
      }
    });
    const legend = document.getElementById("legend");
    legend.replaceChildren();
    [...ranks].sort((a, b) => a - b).forEach((r, i) => {
      const color = COLORS[i % COLORS.length];
      const d = pts.filter(p => p.steps_per_s[r] !== null && p.steps_per_s[r] !== undefined)
        .map((p, k) => (k ? "L" : "M") + x(p.time).toFixed(1) + " " + y(p.steps_per_s[r]).toFixed(1))
        .join(" ");
      if (!d) return;
      const path = document.createElementNS(ns, "path");
      path.setAttribute("d", d); path.setAttribute("fill", "none");
      path.setAttribute("stroke", color); path.setAttribute("stroke-width", "2");
      path.setAttribute("data-rank", r);
      svg.appendChild(path);
      legend.appendChild(el("span", {}, [el("i", {style: {background: color}}),
        document.createTextNode("worker " + r)]));
    });
    legend.appendChild(el("span", {class: "muted", text: "top of the chart: " + fmt(top) +
      " steps/s"}));
  }

  function renderEvents(s) {
    const list = document.getElementById("events");
    list.replaceChildren(...s.events.slice().reverse().map(e => el("li", {
      class: "ev-" + e.kind, "data-kind": e.kind}, [
      el("span", {class: "muted", text: new Date(e.time * 1000).toLocaleTimeString() + " "}),
      el("span", {class: "kind", text: e.kind}), document.createTextNode(e.text)])));
  }

  function render(s) {
    renderJob(s); renderWorkers(s); renderServers(s); renderFailovers(s); renderTimeline(s);
    renderEvents(s);
  }

  function status(kind, text) {
    const c = document.getElementById("conn");
    c.className = "conn " + kind;
    c.textContent = text;
  }

  async function poll() {
    try {
      const r = await fetch(api, {cache: "no-store"});
      if (!r.ok) throw new Error("HTTP " + r.status);
      last = await r.json();
      failures = 0;
      render(last);
      status("ok", "live");
      set("updated", "updated " + new Date().toLocaleTimeString());
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    } catch (err) {
      failures += 1;
      // the last data stays on the page: a job that ended (or a scheduler out of reach) is
      // shown as it was last seen
      status("down", last ? "scheduler unreachable: showing the last data (" + err.message + ")"
                          : "cannot reach the scheduler (" + err.message + ")");
    }
    setTimeout(poll, failures ? Math.min(5000, 1000 * failures) : 1000);
  }
  poll();
})();
