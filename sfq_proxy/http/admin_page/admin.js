// The admin page's script (docs/admin-page.md): it polls the admin JSON endpoints with the
// admin key the operator typed, kept in sessionStorage (never in a URL or a cookie), and
// renders every value with textContent: org names and key aliases are user input.
"use strict";

const KEY_ITEM = "sfq-admin-key";
const POLL_MS = 2000;
const RECENT_SHOWN = 50;
const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { width: 460, height: 150, left: 52, right: 12, top: 10, bottom: 22 };
const SHARE_POINTS = 10; // a share in the last minutes: over the trailing 10 points (10 s)
const COLOURS = 8; // the series' colours: classes c0 to c7 in admin.css
let timer = null;

class Failure extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// GET or send JSON to an admin endpoint (relative to /admin/); an error answer throws a
// Failure carrying its status and the OpenAI-style error's message.
async function call(path, method = "GET", body = undefined) {
  const headers = { Authorization: "Bearer " + sessionStorage.getItem(KEY_ITEM) };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method, headers, cache: "no-store", credentials: "omit",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw new Failure(0, "the proxy did not answer");
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = data && data.error && data.error.message;
    throw new Failure(response.status, message || response.statusText);
  }
  return data;
}

// an element with its children (strings become text nodes, never markup)
function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function num(value, digits = 3) {
  if (value === null || value === undefined) return "—";
  return Number.isInteger(value) ? String(value) : Number(value).toFixed(digits);
}

function list(values) {
  return values === null || values === undefined ? "all" : values.join(", ");
}

// a table of ``rows``, each an array of cells: a string, a number (right-aligned), or a node
// (a row's ``className``, if it has one, is its tr's)
function table(headings, rows) {
  const head = el("tr", null, ...headings.map((h) => el("th", null, h)));
  const body = rows.map((row) => el("tr", row.className, ...row.map((cell) => {
    if (typeof cell === "number") return el("td", "num", num(cell));
    return el("td", null, cell);
  })));
  return el("table", null, el("thead", null, head), el("tbody", null, ...body));
}

// replace a section's content; on a failure, say so in that section alone
function show(section, nodes, failure = null) {
  const box = document.getElementById(section);
  const error = box.querySelector(".error");
  error.hidden = failure === null;
  error.textContent = failure === null ? "" : `Could not load: ${failure.message} (${failure.status || "network"})`;
  if (failure === null) box.querySelector(".body").replaceChildren(...nodes);
}

function poolHeading(name, pool) {
  const shared = pool.shared ? `, shared state: ${pool.shared.mode}` : "";
  return el("h3", null, `${name} — v = ${num(pool.virtual_time)}, ${pool.queued} queued, ` +
    `${pool.running} running${shared}`);
}

function renderPools(pools) {
  return Object.entries(pools).flatMap(([name, pool]) => [
    poolHeading(name, pool),
    table(["Backend", "Health", "Slots in use"], pool.backends.map((b) => [
      b.name,
      el("span", b.healthy ? "healthy" : "down",
        b.healthy ? "healthy" : `down (${b.failures} failures)`),
      `${b.in_flight} / ${b.slots}`,
    ])),
  ]);
}

// -- charts: SVG drawn here from /admin/history (no library: the page loads nothing else) ---

// an SVG element with its attributes and children (text children stay text)
function svg(tag, attributes, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  node.append(...children);
  return node;
}

// the path through the values (null: no value, the line breaks); a lone point is a dot
function pathData(xs, ys) {
  const segments = [];
  let segment = [];
  ys.forEach((y, i) => {
    if (y === null) {
      segment = [];
    } else {
      if (!segment.length) segments.push(segment);
      segment.push(`${xs[i].toFixed(1)},${y.toFixed(1)}`);
    }
  });
  return segments.map((s) => "M" + s.join("L") + (s.length === 1 ? "h0.5" : "")).join("");
}

// a round number at or above ``value`` (1, 2 or 5 times a power of ten)
function ceiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= value);
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

// a line chart of ``series`` ({name, colour, dashed, values: a value or null per point}) at
// the points' ``times``; ``bands``: [from, to, label] spans shaded as down
function plot(kind, title, times, series, format, { top = null, bands = [] } = {}) {
  const { width, height, left, right, top: pad, bottom } = PLOT;
  const values = series.flatMap((s) => s.values).filter((v) => v !== null);
  const high = top === null ? ceiling(Math.max(0, ...values)) : top;
  const [t0, t1] = [times[0], times[times.length - 1]];
  const x = (t) => left + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (width - left - right);
  const y = (v) => height - bottom - (Math.min(v, high) / high) * (height - bottom - pad);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "plot", role: "img",
    "aria-label": title });
  for (const [from, to, label] of bands) { // within the plot, a point's span at least 1 px
    const [x0, x1] = [Math.max(left, x(from)), Math.min(width - right, x(to))];
    root.append(svg("rect", { class: "down-band", x: Math.min(x0, x1 - 1), y: pad,
      width: Math.max(1, x1 - x0), height: height - bottom - pad }, svg("title", {}, label)));
  }
  root.append(
    svg("line", { class: "axis", x1: left, y1: y(0), x2: width - right, y2: y(0) }),
    svg("line", { class: "axis", x1: left, y1: pad, x2: left, y2: y(0) }),
    svg("text", { class: "tick", x: left - 4, y: pad + 8, "text-anchor": "end" }, format(high)),
    svg("text", { class: "tick", x: left - 4, y: y(0), "text-anchor": "end" }, format(0)),
    svg("text", { class: "tick", x: left, y: height - 6 }, clock(t0)),
    svg("text", { class: "tick", x: width - right, y: height - 6, "text-anchor": "end" },
      clock(t1)),
  );
  const xs = times.map(x);
  for (const s of series) {
    const ys = s.values.map((v) => (v === null ? null : y(v)));
    const colour = `c${s.colour % COLOURS}${s.dashed ? " dashed" : ""}`;
    root.append(svg("path", { class: `series ${colour}`, d: pathData(xs, ys),
      "data-series": s.name }, svg("title", {}, s.name)));
  }
  const legend = el("ul", "legend", ...series.map((s) =>
    el("li", `c${s.colour % COLOURS}${s.dashed ? " dashed" : ""}`, s.name)),
    ...[...new Set(bands.map((band) => band[2]))].map((label) => el("li", "band", label)));
  const figure = el("figure", "chart", el("figcaption", null, title), root, legend);
  figure.dataset.chart = kind;
  figure.dataset.points = String(times.length);
  return figure;
}

const percent = (v) => `${Math.round(v * 100)} %`;
const count = (v) => num(v, 1);
const seconds = (v) => (v >= 1 || v === 0 ? `${num(v, 1)} s` : `${num(v * 1000, 0)} ms`);

// each point's share of ``flow`` in ``field`` (served or entitled), summed over the trailing
// ``span`` points; null where nothing was served
function shares(points, field, flow, span) {
  return points.map((_, i) => {
    let part = 0;
    let whole = 0;
    for (const point of points.slice(Math.max(0, i - span + 1), i + 1)) {
      part += point[field][flow] || 0;
      whole += Object.values(point[field]).reduce((a, b) => a + b, 0);
    }
    return whole > 0 ? part / whole : null;
  });
}

function poolCharts(points, recent) {
  const times = points.map((p) => p.end);
  const flows = [...new Set(points.flatMap((p) => [...Object.keys(p.served),
    ...Object.keys(p.entitled)]))].sort();
  const span = recent ? SHARE_POINTS : 1;
  const backends = [...new Set(points.flatMap((p) => Object.keys(p.backends)))];
  const load = (name, field) => points.map((p) => {
    const backend = p.backends[name];
    return backend ? backend[field] : null; // not in the pool then (a reload)
  });
  const down = backends.flatMap((name) => points
    .filter((p) => p.backends[name] && p.backends[name].healthy < 1)
    .map((p) => [p.end - p.span_s, p.end, `${name} down`]));
  const over = recent ? `trailing ${SHARE_POINTS} s` : "per point";
  return [
    plot("shares", `Share of the cost served (solid, ${over}) and entitled to (dashed: what ` +
      "the waiting flows had together, split by weight)", times, flows.flatMap((flow, i) => [
      { name: `${flow} served`, colour: i, values: shares(points, "served", flow, span) },
      { name: `${flow} entitled`, colour: i, dashed: true,
        values: shares(points, "entitled", flow, span) },
    ]), percent, { top: 1 }),
    plot("queue", "Requests waiting (the most at a sample)", times,
      [{ name: "queued", colour: 0, values: points.map((p) => p.queued) }], count),
    plot("wait", "Queue wait: p50 (solid) and p99 (dashed) of the requests dispatched", times, [
      { name: "p50", colour: 1, values: points.map((p) => p.wait_p50_s) },
      { name: "p99", colour: 1, dashed: true, values: points.map((p) => p.wait_p99_s) },
    ], seconds),
    plot("backends", "Backends: in flight (solid) against slots (dashed); shaded: down", times,
      backends.flatMap((name, i) => [
        { name: `${name} in flight`, colour: i, values: load(name, "in_flight") },
        { name: `${name} slots`, colour: i, dashed: true, values: load(name, "slots") },
      ]), count, { bands: down }),
  ];
}

// each pool's charts of ``series`` (recent or since_start) of an /admin/history answer
function renderCharts(answer, series) {
  return Object.entries(answer.pools).flatMap(([name, pool]) => {
    const points = pool[series];
    return [
      el("h3", null, name),
      points.length ? el("div", "charts", ...poolCharts(points, series === "recent"))
        : el("p", "muted", "No sample yet: the proxy takes one a second."),
    ];
  });
}

function renderFlows(pools) {
  return Object.entries(pools).flatMap(([name, pool]) => {
    const shares = pool.served_recent.shares;
    const costs = pool.costs;
    const spent = (flow) => {
      const c = costs[flow];
      return c === undefined ? ["—", "—"] : [num(c.charged, 0), num(c.actual, 0)];
    };
    const rows = pool.flows.map((f) => [
      f.flow, f.weight, f.meter, f.lag, f.queued,
      f.eligible ? "yes" : "at a cap", share(shares[f.flow]), ...spent(f.flow),
    ]);
    const tracked = new Set(pool.flows.map((f) => f.flow));
    const idle = new Set([...Object.keys(shares), ...Object.keys(costs)]);
    for (const flow of [...idle].sort()) {
      if (!tracked.has(flow)) {
        rows.push([flow, "—", "—", "—", 0, "idle", share(shares[flow]), ...spent(flow)]);
      }
    }
    const minutes = num(pool.served_recent.window_s / 60, 0);
    return [
      el("h3", null, name),
      rows.length ? table(["Flow (org/class)", "Weight", "Meter", "Lag behind v", "Queued",
        "Eligible", `Share, last ${minutes} min`, "Cost charged", "Cost actual"], rows)
        : el("p", "muted", "No flow waiting or served lately."),
    ];
  });
}

function share(part) {
  return part === undefined ? "0.0 %" : `${(part * 100).toFixed(1)} %`;
}

function renderRecent(pools) {
  return Object.entries(pools).flatMap(([name, pool]) => {
    const all = pool.recent_dispatches;
    const shown = all.slice(-RECENT_SHOWN);
    const first = all.length - shown.length + 1;
    const rows = shown.map((d, i) => [
      first + i, d.flow, d.backend, d.cost, d.weight, d.v, d.start_tag, d.finish_tag,
      `${num(d.age_s, 1)} s ago`,
    ]);
    return [
      el("h3", null, pool.shared ? `${name} (this process's dispatches)` : name),
      rows.length ? table(["#", "Flow", "Backend", "Cost", "Weight", "v before", "Start tag",
        "Finish tag", "When"], rows) : el("p", "muted", "Nothing dispatched yet."),
    ];
  });
}

function renderKeys(keys) {
  const rows = keys.map((k) => {
    const row = [
      k.id, k.alias, k.org, k.access.classes.join(", ") || "none",
      access(k.access.pools, k.pools, k.org),
      access(k.access.models, k.models, k.org), k.expires || "never", k.last_used || "—",
      k.created || "—", el("span", `badge ${k.status}`, k.status), keyAction(k),
    ];
    row.className = `key ${k.status}`;
    return row;
  });
  return [table(["Id", "Alias", "Org", "Classes", "Pools", "Models", "Expires", "Last used",
    "Created", "Status", ""], rows)];
}

// what a key may use in fact (its list met with its org's); marked where its org narrows it
function access(effective, own, org) {
  const shown = list(effective); // sorted, as the proxy sends it
  if (list(own && [...own].sort()) === shown) return shown;
  return el("span", null, shown, " ", el("span", "via-org", `(by org ${org})`));
}

function keyAction(key) {
  if (key.status === "revoked") return el("span", "muted", `revoked ${key.revoked}`);
  if (key.source !== "api") return el("span", "muted", "read-only (config file)");
  const button = el("button", "revoke", "Revoke");
  button.type = "button";
  button.dataset.id = key.id;
  button.addEventListener("click", () => revoke(key));
  return button;
}

async function revoke(key) {
  if (!window.confirm(`Revoke key ${key.alias} (${key.id}) of ${key.org}? It stops working at once.`)) return;
  await act(`Revoking ${key.alias}`, async () => {
    await call(`keys/${encodeURIComponent(key.id)}`, "DELETE");
  });
}

// a change made through the page (create, revoke): its failure stays on screen, under the
// form, until the next change (the polls would otherwise replace it within 2 s)
async function act(what, change) {
  const line = document.getElementById("key-action");
  line.hidden = true;
  try {
    await change();
  } catch (failure) {
    if (!(failure instanceof Failure)) throw failure;
    if (failure.status === 401) return handle("keys", failure);
    line.textContent = `${what} failed: ${failure.message} (${failure.status || "network"})`;
    line.hidden = false;
  }
  await refreshKeys();
}

function renderUsage(usage) {
  const rows = usage.rows.map((r) => [
    r.org, r.requests, r.prompt_tokens, r.completion_tokens, r.charged_cost, r.actual_cost,
    r.money === null ? "—" : num(r.money, 2),
  ]);
  return [
    el("p", "muted", `From ${usage.since} to ${usage.until}`),
    rows.length ? table(["Org", "Requests", "Prompt tokens", "Completion tokens",
      "Charged cost", "Actual cost", "Money"], rows) : el("p", "muted", "No usage yet today."),
  ];
}

// a failed endpoint: a refused key stops everything and asks for it again; anything else
// is that section's message alone
function handle(section, failure) {
  if (!(failure instanceof Failure)) throw failure;
  if (failure.status === 401) {
    signOut(`The admin key was refused (401): ${failure.message} Enter it again.`);
  } else {
    show(section, [], failure);
  }
}

async function refreshState() {
  try {
    const pools = (await call("state")).pools;
    show("pools", renderPools(pools));
    show("flows", renderFlows(pools));
    show("recent", renderRecent(pools));
  } catch (failure) {
    for (const section of ["pools", "flows", "recent"]) handle(section, failure);
  }
}

// the series the page shows, alone (half the bytes of both)
async function refreshHistory() {
  const series = document.getElementById("chart-window").value;
  try {
    show("charts", renderCharts(await call(`history?series=${series}`), series));
  } catch (failure) {
    handle("charts", failure);
  }
}

async function refreshKeys() {
  try {
    show("keys", renderKeys((await call("keys")).keys));
  } catch (failure) {
    handle("keys", failure);
  }
}

async function refreshUsage() {
  try {
    show("usage", renderUsage(await call("usage?group_by=org")));
  } catch (failure) {
    handle("usage", failure);
  }
}

async function poll() {
  timer = null;
  await Promise.all([refreshState(), refreshHistory(), refreshKeys(), refreshUsage()]);
  if (sessionStorage.getItem(KEY_ITEM) !== null && timer === null) {
    timer = setTimeout(poll, POLL_MS);
    setStatus(`Updated ${new Date().toLocaleTimeString()}; refreshes every ${POLL_MS / 1000} s.`);
  }
}

function setStatus(text, bad = false) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("bad", bad);
}

function signIn() {
  document.getElementById("login").hidden = true;
  document.getElementById("logout").hidden = false;
  document.getElementById("panels").hidden = false;
  poll();
}

function signOut(message) {
  sessionStorage.removeItem(KEY_ITEM);
  clearTimeout(timer);
  timer = null;
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
  document.getElementById("panels").hidden = true;
  setStatus(message, message !== "Enter the admin key to see the proxy.");
}

// the create form's fields as POST /admin/keys wants them: lists split at commas, an
// empty list or expiry left out (all pools and models, no expiry)
function newKeyBody(form) {
  const data = new FormData(form);
  const body = { alias: data.get("alias").trim(), org: data.get("org").trim() };
  for (const field of ["classes", "pools", "models"]) {
    const items = data.get(field).split(",").map((s) => s.trim()).filter(Boolean);
    if (items.length) body[field] = items;
  }
  const days = data.get("expires_days");
  if (days !== "") body.expires_in_s = Number(days) * 86400;
  return body;
}

async function createKey(event) {
  event.preventDefault();
  const form = event.target;
  await act("Creating the key", async () => {
    const made = await call("keys", "POST", newKeyBody(form));
    form.reset();
    const secret = document.getElementById("secret");
    secret.querySelector("code").textContent = made.secret;
    secret.hidden = false;
  });
}

function hideSecret() {
  const secret = document.getElementById("secret");
  secret.querySelector("code").textContent = "";
  secret.hidden = true;
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("admin-key");
    sessionStorage.setItem(KEY_ITEM, input.value.trim());
    input.value = "";
    setStatus("Loading…");
    signIn();
  });
  document.getElementById("logout").addEventListener("click", () => {
    signOut("Enter the admin key to see the proxy.");
  });
  document.getElementById("new-key").addEventListener("submit", createKey);
  document.getElementById("chart-window").addEventListener("change", refreshHistory);
  document.querySelector("#secret button").addEventListener("click", hideSecret);
  if (sessionStorage.getItem(KEY_ITEM) !== null) signIn();
});
