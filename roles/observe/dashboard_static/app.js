// rolectl dashboard: render /api/state snapshots pushed over server-sent events. Plain JS, own SVG plots.
"use strict";

const $ = (id) => document.getElementById(id);
let last = null; // the latest snapshot, for the "updated … ago" ticker and resizes

// ---------------------------------------------------------------------------------------------
// formatting

function esc(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function fmtBytes(n) {
  if (n == null) return "–";
  const units = [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
  for (const [u, s] of units) if (n >= s) return (n / s).toFixed(n >= 10 * s ? 0 : 1) + " " + u;
  return n + " B";
}
function fmtAgo(ms) {
  if (ms == null) return "never";
  const s = Math.max(0, ms / 1000);
  if (s < 1) return "just now";
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s ago";
  if (s < 3600) return (s / 60).toFixed(1) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function fmtSec(s) {
  if (s == null) return "–";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
  if (s < 120) return s.toFixed(2) + " s";
  return (s / 60).toFixed(1) + " min";
}
function fmtNum(n, digits = 3) {
  if (n == null) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return Number.isInteger(n) ? String(n) : n.toFixed(digits);
}
function fmtTime(ms) {
  if (ms == null) return "–";
  return new Date(ms).toISOString().slice(11, 23);
}
const short = (key) => (key && key.includes("/") ? key.split("/").slice(1).join("/") : key || "");

// ---------------------------------------------------------------------------------------------
// plots (inline SVG)

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const f of [1, 2, 2.5, 5, 10]) if (raw <= f * mag) return f * mag;
  return 10 * mag;
}
function ticks(min, max, count) {
  const step = niceStep(max - min || 1, count);
  const out = [];
  for (let v = Math.ceil(min / step) * step; v <= max + step * 1e-9; v += step) out.push(+v.toFixed(10));
  out.step = step;
  return out;
}
// Enough decimals that neighbouring ticks read differently (0.085, 0.09 rather than 0.09, 0.09).
function tickFmt(step) {
  let digits = 0; // the fewest decimals that write the step exactly
  while (digits < 6 && Math.abs(Math.round(step * 10 ** digits) - step * 10 ** digits) > 1e-6) digits++;
  return (v) => (Math.abs(v) >= 1e4 ? fmtNum(v) : v.toFixed(Math.min(6, digits)));
}

// series: [{name, color, points: [[x, y], ...], dots}], opts: {xLabel, yFmt, empty}
function lineChart(el, series, opts) {
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] != null));
  if (!pts.length) {
    el.innerHTML = `<div class="empty">${esc(opts.empty || "no data yet")}</div>`;
    return;
  }
  const W = el.clientWidth || 520, H = el.clientHeight || 210;
  const m = { l: 52, r: 14, t: 10, b: 40 };
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (opts.zeroBased) y0 = Math.min(0, y0);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const yPad = (y1 - y0) * 0.08; y1 += yPad; if (!opts.zeroBased) y0 -= yPad;
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const Y = (y) => H - m.b - ((y - y0) / (y1 - y0)) * (H - m.t - m.b);
  const yt = ticks(y0, y1, 4);
  const yf = opts.yFmt || tickFmt(yt.step);
  let svg = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" role="img">`;
  svg += `<g class="axis">`;
  for (const t of yt) {
    svg += `<line class="grid-line" x1="${m.l}" x2="${W - m.r}" y1="${Y(t)}" y2="${Y(t)}"/>`;
    svg += `<text x="${m.l - 6}" y="${Y(t) + 4}" text-anchor="end">${esc(yf(t))}</text>`;
  }
  const xt = ticks(x0, x1, Math.max(2, Math.floor((W - m.l - m.r) / 70))).filter((t) => !opts.intX || Number.isInteger(t));
  for (const t of xt) svg += `<text x="${X(t)}" y="${H - m.b + 15}" text-anchor="middle">${esc(fmtNum(t, 1))}</text>`;
  svg += `<line x1="${m.l}" x2="${W - m.r}" y1="${H - m.b}" y2="${H - m.b}"/>`;
  svg += `<text x="${(m.l + W - m.r) / 2}" y="${H - 6}" text-anchor="middle">${esc(opts.xLabel || "")}</text>`;
  svg += `</g>`;
  for (const s of series) {
    const p = s.points.filter((q) => q[1] != null);
    if (!p.length) continue;
    const d = p.map((q, i) => `${i ? "L" : "M"}${X(q[0]).toFixed(1)},${Y(q[1]).toFixed(1)}`).join("");
    svg += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2" stroke-linejoin="round"/>`;
    if (p.length <= 80) {
      for (const q of p) {
        svg += `<circle cx="${X(q[0]).toFixed(1)}" cy="${Y(q[1]).toFixed(1)}" r="2.6" fill="${s.color}">` +
          `<title>${esc(s.name)} ${esc(fmtNum(q[0], 1))}: ${esc(yf(q[1]))}</title></circle>`;
      }
    }
  }
  svg += `</svg>`;
  const legend = series.length > 1
    ? `<div class="legend">${series.map((s) => `<span><i style="background:${s.color}"></i>${esc(s.name)}</span>`).join("")}</div>`
    : "";
  el.innerHTML = svg + legend;
}

const OUTCOME_COLOR = {
  completed: "#1f9d55", no_new_version: "#2a7f95", trainer_stopped: "#c98a00", abandoned: "#c98a00",
  timed_out: "#d64545", failed: "#d64545", open: "#2f6fde",
};

// One lane per member that opened rounds; a bar from open to close (or now), coloured by outcome.
function roundsTimeline(el, rounds, nowMs) {
  if (!rounds.length) { el.innerHTML = `<div class="empty">no sync round yet</div>`; return; }
  const lanes = [...new Set(rounds.map((r) => r.opened_by))].sort();
  const m = { l: 110, r: 14, t: 6, b: 22 };
  const laneH = 24;
  el.style.height = `${m.t + m.b + lanes.length * laneH}px`; // as tall as its lanes, no taller
  const W = el.clientWidth || 900, H = el.clientHeight || m.t + m.b + lanes.length * laneH;
  const end = Math.max(nowMs, ...rounds.map((r) => r.closed_at_ms || 0));
  const start = Math.min(...rounds.map((r) => r.opened_at_ms));
  const span = Math.max(1000, end - start);
  const X = (t) => m.l + ((t - start) / span) * (W - m.l - m.r);
  let svg = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none"><g class="axis">`;
  lanes.forEach((lane, i) => {
    const y = m.t + i * laneH;
    svg += `<text x="${m.l - 8}" y="${y + laneH / 2 + 4}" text-anchor="end">${esc(short(lane))}</text>`;
    svg += `<line class="grid-line" x1="${m.l}" x2="${W - m.r}" y1="${y + laneH}" y2="${y + laneH}"/>`;
  });
  for (const t of ticks(0, span / 1000, Math.max(2, Math.floor((W - m.l - m.r) / 90)))) {
    const x = X(start + t * 1000);
    svg += `<text x="${x}" y="${H - 6}" text-anchor="middle">${esc(fmtNum(t - span / 1000, 1))} s</text>`;
  }
  svg += `</g>`;
  for (const r of rounds) {
    const lane = lanes.indexOf(r.opened_by);
    const y = m.t + lane * laneH + 3;
    const x = X(r.opened_at_ms), x2 = X(r.closed_at_ms ?? nowMs);
    const color = OUTCOME_COLOR[r.outcome || "open"] || "#8a94a3";
    const dur = r.duration_ms != null ? fmtSec(r.duration_ms / 1000) : "open";
    svg += `<rect x="${x.toFixed(1)}" y="${y}" width="${Math.max(3, x2 - x).toFixed(1)}" height="${Math.max(4, laneH - 6)}"` +
      ` rx="2" fill="${color}" fill-opacity="0.85"><title>round ${r.id}: ${esc(r.outcome || "open")}, ${dur}` +
      ` (${esc(r.participants.map(short).join(", "))})</title></rect>`;
  }
  svg += `</svg>`;
  el.innerHTML = svg;
}

// ---------------------------------------------------------------------------------------------
// sections

function renderHeader(s) {
  $("job").textContent = s.job;
  document.title = `rolectl · ${s.job} · v${s.latest.version}`;
  const pill = $("conn-pill");
  // once the job ended the page is a record, not a live view: say so (and why)
  const ended = s.job_state && s.job_state.ended;
  const state = ended ? `ended · ${s.job_state.outcome}` : s.connection.state;
  pill.textContent = state;
  pill.title = ended ? s.job_state.reason : "";
  pill.className = "pill " + (ended ? "pill-wait" : state === "live" ? "pill-live" : state === "reconnecting" ? "pill-bad" : "pill-wait");
  $("stream-seq").textContent = s.stream.last_seq;
  // archive + live tail read as one history: say how much of it came from the archive
  const history = $("history");
  history.hidden = !s.archive.dir;
  history.dataset.archivedUpto = s.archive.upto_seq;
  history.textContent = s.archive.upto_seq ? `· archive to seq ${s.archive.upto_seq} + live stream` : "· no archive yet";
  const banner = $("banner");
  const problems = [];
  if (s.connection.error) problems.push(s.connection.error);
  if (s.archive.error) problems.push(s.archive.error);
  if (s.stream.illegal) problems.push(`${s.stream.illegal} input(s) refused by the reducer (see the event log)`);
  banner.hidden = !problems.length;
  banner.textContent = problems.join(" · ");
}

function renderKpis(s) {
  const members = s.members.filter((m) => m.role !== "synchronizer");
  const holders = s.latest.held_by.length;
  $("latest-version").textContent = "v" + s.latest.version;
  $("latest-version").dataset.version = s.latest.version;
  $("latest-sub").textContent = s.latest.published_ms
    ? `held by ${holders}/${members.length} · ${fmtAgo(s.now_ms - s.latest.published_ms)}`
    : s.latest.version === 0 ? "base model" : `held by ${holders}/${members.length}`;
  const t = s.trainer;
  $("trainer-step").textContent = t ? (t.total_steps ? `${t.step} / ${t.total_steps}` : t.step) : "–";
  $("trainer-sub").textContent = t ? `${t.status}` + (t.metrics.reward_mean != null ? ` · reward ${fmtNum(t.metrics.reward_mean)}` : "") : "no trainer yet";
  const rs = s.rounds_summary;
  $("rounds-closed").textContent = rs.closed;
  const bad = Object.entries(rs.outcomes).filter(([k]) => k !== "completed").map(([k, v]) => `${v} ${k.replace(/_/g, " ")}`);
  $("rounds-sub").textContent = `${rs.open ? rs.open + " open" : "none open"}` + (bad.length ? " · " + bad.join(", ") : "");
  $("moved").textContent = fmtBytes(s.throughput.bytes_loaded_total);
  $("moved-sub").textContent = s.throughput.last_gbps != null ? `last ${s.throughput.last_gbps.toFixed(3)} GB/s · ${s.throughput.transfers} loads` : `${s.throughput.transfers} loads`;
  const st = s.staleness;
  $("staleness").textContent = st.mean != null ? st.mean.toFixed(2) : "–";
  $("staleness-sub").textContent = st.mean != null ? `versions behind · ${fmtNum(st.dropped_total, 0)} dropped` : "no trainer step yet";
  const sv = s.served;  // serve mode only
  $("served-kpi").hidden = !sv;
  if (sv) {
    $("served-rate").textContent = sv.per_s != null ? `${fmtNum(sv.per_s, 1)}/s` : "–";
    $("served-sub").textContent = `${fmtNum(sv.served_requests, 0)} served · ${fmtNum(sv.rewarded, 0)} rewarded · ${fmtNum(sv.expired, 0)} expired`;
  }
  const n = s.nats;
  if (n.ok) {
    $("nats-conns").textContent = n.server.connections;
    $("nats-sub").textContent = `connections · ${n.server.slow_consumers} slow consumers`;
  } else {
    $("nats-conns").textContent = n.ok === false ? "down" : "–";
    $("nats-sub").textContent = n.error || "polling…";
  }
}

// a member's progress: its step against its total; a synchronizer has no steps: what was decided
function progressText(m) {
  if (m.role === "synchronizer") {
    if (!m.decisions) return "–";
    return `${m.decisions} decisions` + (m.last_round != null ? `, round ${m.last_round}` : "");
  }
  return m.total_steps ? `${m.step} / ${m.total_steps} (${Math.round(m.fraction * 100)}%)` : m.step;
}

// A fleet of a thousand is shown a page at a time, the stragglers first (the server orders them),
// under the counts of every role by status; the page shown stays put across updates.
const MEMBERS_PER_PAGE = 50;
const STATUSES = ["running", "require_sync", "finished", "stopped", "expired"];
let membersPage = 0;

function renderMemberCounts(s) {
  $("member-counts").innerHTML = Object.entries(s.member_counts || {}).map(([role, c]) =>
    `<span class="role-count" data-role="${esc(role)}"><span class="role role-${esc(role)}">${esc(role)}</span>` +
    STATUSES.filter((st) => c[st]).map((st) =>
      `<span class="status s-${st}" data-status="${st}"><span class="dot"></span><span class="n">${c[st]}</span> ` +
      `${st.replace("_", " ")}</span>`).join("") +
    `<span class="dim">of ${c.total}</span></span>`).join("");
}

function renderMembers(s) {
  renderMemberCounts(s);
  const body = $("members").querySelector("tbody");
  const pages = Math.max(1, Math.ceil(s.members.length / MEMBERS_PER_PAGE));
  membersPage = Math.min(membersPage, pages - 1);
  const first = membersPage * MEMBERS_PER_PAGE;
  const shown = s.members.slice(first, first + MEMBERS_PER_PAGE);
  $("members-pager").hidden = pages <= 1;
  $("members-page").textContent = `${first + 1}–${first + shown.length} of ${s.members.length}`;
  $("members-prev").disabled = membersPage === 0;
  $("members-next").disabled = membersPage >= pages - 1;
  if (!s.members.length) { body.innerHTML = `<tr><td colspan="7" class="empty">no member has joined yet</td></tr>`; return; }
  body.innerHTML = shown.map((m) => {
    const latest = m.role === "synchronizer" ? "" : m.has_latest
      ? `<span class="latest-mark" title="holds the latest version">✓</span>`
      : `<span class="behind" title="behind the latest version">${s.latest.version - m.version} behind</span>`;
    return `<tr data-member="${esc(m.key)}" data-status="${esc(m.status)}" data-version="${m.version}">` +
      `<td><span class="role role-${esc(m.role)}">${esc(m.role)}</span></td>` +
      `<td class="mono">${esc(m.id)}</td>` +
      `<td><span class="status s-${esc(m.status)}"><span class="dot"></span>${esc(m.status.replace("_", " "))}</span></td>` +
      `<td class="num">${progressText(m)}</td>` +
      `<td class="num version">${m.role === "synchronizer" ? "–" : m.version}${latest}</td>` +
      `<td>${esc(fmtAgo(m.last_seen_ago_ms))}</td>` +
      `<td class="mono">${esc(m.host)}</td></tr>`;
  }).join("");
}

const CHIPS_SHOWN = 24;  // a fleet's chips would fill the page: those behind first, then a count

function renderVersions(s) {
  const L = s.latest;
  const members = s.members.filter((m) => m.role !== "synchronizer");
  const behind = members.filter((m) => m.version < L.version);
  const holding = members.filter((m) => m.version >= L.version);
  const listed = [...behind, ...holding].slice(0, CHIPS_SHOWN);
  const chips = listed.map((m) => m.version >= L.version
    ? `<span class="chip has">${esc(m.id)} ✓</span>`
    : `<span class="chip lacks">${esc(m.id)} v${m.version}</span>`).join("") +
    (members.length > listed.length
      ? `<span class="chip more">+${members.length - listed.length} more · ${holding.length}/${members.length} hold v${L.version}</span>`
      : "");
  const rows = s.versions.slice(-8).reverse().map((v) =>
    `<tr><td class="num">v${v.version}</td><td class="num">${v.step}</td><td>${esc(v.method)}</td>` +
    `<td class="num">${fmtBytes(v.nbytes)}</td><td class="mono">${fmtTime(v.time_ms)}</td></tr>`).join("");
  $("versions").innerHTML =
    `<div class="big-version" id="versions-latest">v${L.version}</div>` +
    `<div class="dim small">${L.method ? `step ${L.step} · ${esc(L.method)} · ${fmtBytes(L.nbytes)}` : "the base model"}` +
    `${L.digest ? ` · <span class="mono">${esc(L.digest.slice(0, 19))}…</span>` : ""}</div>` +
    `<div class="chips">${chips || '<span class="dim">no member yet</span>'}</div>` +
    (rows ? `<table class="table compact"><thead><tr><th class="num">version</th><th class="num">step</th><th>method</th>` +
      `<th class="num">size</th><th>published (UTC)</th></tr></thead><tbody>${rows}</tbody></table>` : "");
}

function renderPlots(s) {
  // the eval curve beside the training reward: eval of version N sits at trainer step N
  const evalColors = ["#d9822b", "#1f9d55", "#2a7f95", "#d64545"];
  const evals = Object.entries(s.series.eval || {}).map(([name, points], i) =>
    ({ name: `eval ${name}`, color: evalColors[i % evalColors.length], points }));
  lineChart($("plot-reward"), [{ name: "reward_mean", color: "#7a3fc7", points: s.series.reward }, ...evals],
    { xLabel: "trainer step (= version)", intX: true, empty: "no trainer step yet" });
  const sync = s.series.sync_time;
  lineChart($("plot-sync"), [
    { name: "open → close", color: "#2f6fde", points: sync.map((p) => [p[0], p[1]]) },
    { name: "weights transfer", color: "#1f9d55", points: sync.map((p) => [p[0], p[2]]) },
  ], { xLabel: "round", intX: true, zeroBased: true, yFmt: (v) => fmtSec(v), empty: "no closed round yet" });
}

function renderRounds(s) {
  const rounds = s.rounds;
  roundsTimeline($("rounds-timeline"), rounds, s.now_ms);
  $("rounds-caption").textContent = rounds.length ? `(last ${rounds.length} of ${s.rounds_summary.total})` : "";
  const body = $("rounds").querySelector("tbody");
  if (!rounds.length) { body.innerHTML = `<tr><td colspan="10" class="empty">no sync round yet</td></tr>`; return; }
  body.innerHTML = rounds.slice(-14).reverse().map((r) => {
    const got = [...new Set(r.releases.filter((x) => x.reason === "new_version").map((x) => "v" + x.version))];
    if (r.rendezvous) got.push("v" + r.rendezvous.version);
    const outcome = r.outcome || "open";
    return `<tr data-round="${r.id}"><td class="num">${r.id}</td><td class="mono">${esc(short(r.opened_by))}</td>` +
      `<td>${esc(r.method)}</td><td class="small">${esc(r.waited_for.map(short).join(", ") || "— served at once")}</td>` +
      `<td class="small">${esc(r.participants.map(short).join(", "))}</td>` +
      `<td>v${r.version}${got.length ? " → " + got.join(", ") : ""}</td>` +
      `<td class="num">${r.duration_ms != null ? fmtSec(r.duration_ms / 1000) : "…"}</td>` +
      `<td class="o-${esc(outcome)}">${esc(outcome.replace(/_/g, " "))}</td>` +
      `<td class="num">${r.nbytes ? fmtBytes(r.nbytes) : "–"}</td>` +
      `<td class="num">${r.gbps != null ? r.gbps.toFixed(3) : "–"}</td></tr>`;
  }).join("");
}

function renderNats(s) {
  const n = s.nats;
  if (!n.ok) { $("nats").innerHTML = `<div class="empty">${esc(n.error || "polling the monitoring endpoint…")}</div>`; return; }
  const sv = n.server, js = n.jetstream;
  const kv = [
    ["connections", sv.connections], ["slow consumers", sv.slow_consumers], ["uptime", sv.uptime],
    ["msgs in", fmtNum(sv.in_msgs)], ["msgs out", fmtNum(sv.out_msgs)], ["server", "v" + sv.version],
    ["bytes in", fmtBytes(sv.in_bytes)], ["bytes out", fmtBytes(sv.out_bytes)], ["js storage", fmtBytes(js.storage)],
  ];
  const streams = n.streams.map((st) =>
    `<tr${st.ours ? "" : ' class="dim"'}><td class="mono">${esc(st.name)}</td><td class="num">${fmtNum(st.messages)}</td>` +
    `<td class="num">${fmtBytes(st.bytes)}</td><td class="num">${st.consumers}</td></tr>`).join("");
  $("nats").innerHTML =
    `<div class="kv">${kv.map(([k, v]) => `<div><span class="k">${esc(k)}</span><span class="v">${esc(v)}</span></div>`).join("")}</div>` +
    `<table class="table compact"><thead><tr><th>stream</th><th class="num">messages</th><th class="num">bytes</th>` +
    `<th class="num">consumers</th></tr></thead><tbody>${streams}</tbody></table>`;
}

function renderLog(s) {
  $("log").innerHTML = s.log.slice().reverse().map((l) =>
    `<div class="log-row${l.decision ? " decision" : ""}${l.illegal ? " illegal" : ""}" title="${esc(l.illegal || l.kind)}">` +
    `<span class="seq">${l.seq}</span><span class="dim">${fmtTime(l.time_ms)}</span>` +
    `<span class="who">${esc(l.decision ? "⇢ synchronizer" : l.who)}</span>` +
    `<span>${esc(l.text)}${l.illegal ? " — refused: " + esc(l.illegal) : ""}</span></div>`).join("");
}

function render(s) {
  last = s;
  last.received = Date.now();
  renderHeader(s);
  renderKpis(s);
  renderMembers(s);
  renderVersions(s);
  renderPlots(s);
  renderRounds(s);
  renderNats(s);
  renderLog(s);
  tick();
}

function tick() {
  if (last) $("updated").textContent = fmtAgo(Date.now() - last.received);
}

// ---------------------------------------------------------------------------------------------
// wiring

function connect() {
  const source = new EventSource("/api/events");
  source.onmessage = (e) => render(JSON.parse(e.data));
  source.onerror = () => {
    const pill = $("conn-pill");
    pill.textContent = "dashboard unreachable";
    pill.className = "pill pill-bad";
  }; // EventSource reconnects by itself
}

function turnMembersPage(by) {
  membersPage = Math.max(0, membersPage + by);
  if (last) renderMembers(last);
}

$("members-prev").addEventListener("click", () => turnMembersPage(-1));
$("members-next").addEventListener("click", () => turnMembersPage(1));
fetch("/api/state").then((r) => r.json()).then(render).catch(() => {});
connect();
setInterval(tick, 1000);
window.addEventListener("resize", () => last && (renderPlots(last), renderRounds(last)));
