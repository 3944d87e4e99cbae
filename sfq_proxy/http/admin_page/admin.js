// The admin page's script (docs/admin-page.md): it polls the admin JSON endpoints with the
// admin key the operator typed, kept in sessionStorage (never in a URL or a cookie), and
// renders every value with textContent: org names and key aliases are user input.
"use strict";

const KEY_ITEM = "sfq-admin-key";
const POLL_MS = 2000;
const RECENT_SHOWN = 50;
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
function table(headings, rows) {
  const head = el("tr", null, ...headings.map((h) => el("th", null, h)));
  const body = rows.map((row) => el("tr", null, ...row.map((cell) => {
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
  const rows = keys.map((k) => [
    k.id, k.alias, k.org, k.classes.join(", "), list(k.pools), list(k.models),
    k.expires || "never", k.last_used || "—", k.created || "—", keyAction(k),
  ]);
  return [table(["Id", "Alias", "Org", "Classes", "Pools", "Models", "Expires", "Last used",
    "Created", ""], rows)];
}

function keyAction(key) {
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
  await Promise.all([refreshState(), refreshKeys(), refreshUsage()]);
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
  document.querySelector("#secret button").addEventListener("click", hideSecret);
  if (sessionStorage.getItem(KEY_ITEM) !== null) signIn();
});
