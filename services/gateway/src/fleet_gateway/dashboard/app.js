// Fleet dashboard: plain ES module, no build step, no external assets. One module: its views share
// the State kept from /state and /events and the key handling, and the browser test imports its pure
// functions from here; each view is a section below.
const GIB = 1024 ** 3;
const SVG_NS = "http://www.w3.org/2000/svg";
// The named events of /events (fleet_proto.events; a test keeps this list complete).
const EVENT_NAMES = ("service_started service_stopped node_joined node_left instance_placed instance_loading "
  + "instance_ready instance_failed instance_deleted instance_status_changed download_progressed model_staged "
  + "model_deleted scaling_policy_set scaling_decided").split(" ");

const state = {
  data: { nodes: {}, instances: {}, downloads: {}, models: {}, partners: {}, scaling: {} },
  engines: [], // the engines the cluster offers (GET /capabilities), for the create-instance form
  live: {}, // node id -> its latest metrics sample (memory, CPU, GPUs)
  lastJson: "",
  refreshTimer: null,
  modelUi: {}, // per model: {busy, error, placements, placementError, scalingError, scalingEdited, scalingSaved}
  nodeCards: new Map(),
  modelCards: new Map(),
  metricNames: [],
  chat: { messages: [], busy: false, abort: null },
  traces: { selected: "", lastJson: "" },
};
let currentView = "topology";

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "className") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const gib = (bytes) => `${((bytes || 0) / GIB).toFixed(1)} GiB`;

function errorMessage(body, status) {
  return body?.error?.message || body?.detail || `request failed (HTTP ${status})`;
}

async function readJSON(res) {
  try { return await res.json(); } catch { return null; }
}

// A gateway with API keys answers 401 (no or wrong key) or 403 (an admin action): ask once for the
// key, keep it in this browser and send it as a bearer token. A SameSite=Strict cookie carries it
// too, for the GET requests EventSource makes (it cannot set headers); the gateway takes the cookie
// on GET requests only.
const KEY_STORAGE = "fleet_api_key";
let keyAsked = false;

function rememberKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
  document.cookie = `${KEY_STORAGE}=${key}; path=/; SameSite=Strict`;
}

if (localStorage.getItem(KEY_STORAGE)) rememberKey(localStorage.getItem(KEY_STORAGE));

async function authorizedFetch(url, init = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_STORAGE);
    const headers = { ...(init.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const res = await fetch(url, { ...init, headers });
    if ((res.status !== 401 && res.status !== 403) || keyAsked) return res;
    keyAsked = true;  // one prompt per page load, not one per refresh
    const asked = window.prompt(res.status === 401
      ? "This Fleet gateway needs an API key (`fleet key` prints it):"
      : "This action needs the admin key (`fleet key --admin` prints it):");
    if (!asked) return res;
    rememberKey(asked.trim());
    keyAsked = false;
  }
}

async function requestJSON(method, url, body) {
  const init = body === undefined ? { method }
    : { method, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const res = await authorizedFetch(url, init);
  const data = await readJSON(res);
  if (!res.ok) throw new Error(errorMessage(data, res.status));
  return data;
}

// Cards are kept per id and refilled in place, so references to them (and their buttons) survive refreshes.
function keyedCard(cache, id, create) {
  if (!cache.has(id)) cache.set(id, create(id));
  return cache.get(id);
}

function pruneCards(cache, ids) {
  for (const id of [...cache.keys()]) if (!ids.includes(id)) cache.delete(id);
}

// Re-inserting unchanged children would blur a focused button, so only touch the container when they differ.
function setChildren(container, nodes) {
  const current = [...container.childNodes];
  if (current.length === nodes.length && current.every((n, i) => n === nodes[i])) return;
  container.replaceChildren(...nodes);
}

function facts(pairs) {
  return el("dl", { className: "facts" }, pairs.filter((p) => p).map(([k, v]) => [el("dt", {}, k), el("dd", {}, v ?? "—")]));
}

// ---------- views ----------
function showView(name) {
  currentView = name;
  for (const view of ["topology", "models", "metrics", "chat", "traces"]) {
    $(`view-${view}`).hidden = view !== name;
    const button = $(`nav-${view}`);
    if (view === name) button.setAttribute("aria-current", "page");
    else button.removeAttribute("aria-current");
  }
  if (name === "metrics") loadMetricNames().then(refreshMetrics);
  if (name === "chat") refreshChatModels();
  if (name === "traces") refreshTraces();
}

// ---------- state & events ----------

async function refreshState() {
  let data;
  try { data = await requestJSON("GET", "/state"); } catch { return; }
  const json = JSON.stringify(data);
  // Skip re-rendering identical state so open elements (focus, selections) are not replaced.
  if (json === state.lastJson) return;
  state.lastJson = json;
  state.data = {};
  // partners: decoder instance id -> the instances the router would prefill on for it (absent on
  // gateways that do not compute them)
  // scaling: model id -> its policy and latest decisions (the scaling_* events change it)
  for (const key of ["nodes", "instances", "downloads", "models", "partners", "scaling"]) state.data[key] = data?.[key] || {};
  await refreshEngines();
  renderAll();
  refreshChatModels();
}

async function refreshLive() {
  const live = await requestJSON("GET", "/dashboard/live").catch(() => null);
  if (!live || JSON.stringify(live) === JSON.stringify(state.live)) return;
  state.live = live;
  if (state.data.nodes) renderTopology();
}

function scheduleRefresh() {
  if (state.refreshTimer) return;
  state.refreshTimer = setTimeout(() => { state.refreshTimer = null; refreshState(); }, 300);
}

function setStatus(live) {
  const status = $("status");
  status.textContent = live ? "live" : "reconnecting…";
  status.dataset.live = String(live);
}

function connectEvents() {
  const source = new EventSource("/events");
  const onEvent = () => { setStatus(true); scheduleRefresh(); };
  source.onopen = () => { setStatus(true); scheduleRefresh(); };
  source.onmessage = onEvent;
  for (const name of EVENT_NAMES) source.addEventListener(name, onEvent);
  source.onerror = () => {
    setStatus(false);
    // EventSource gives up for good on HTTP errors; reopen it ourselves in that case.
    if (source.readyState === EventSource.CLOSED) setTimeout(connectEvents, 3000);
  };
}

// The engines instances can run on (fleet_proto.engines; a test keeps this list complete): nodes
// also list libraries such as mlx-lm and torch.
const SERVING_ENGINES = ["mlx", "vllm", "llamacpp", "echo"];
// An instance's roles (fleet_gateway.admin.INSTANCE_ROLES): "both" prefills and decodes.
const INSTANCE_ROLES = ["both", "prefill", "decode"];

function servingEngines(nodes) {
  const names = new Set(nodes.flatMap((node) => (node.engines || []).map((engine) => engine.name)));
  return SERVING_ENGINES.filter((name) => names.has(name));
}

// The create-instance form offers what GET /capabilities says the cluster has (the nodes' engines
// when it does not answer); refetched only when state changed.
async function refreshEngines() {
  const caps = await requestJSON("GET", "/capabilities").catch(() => null);
  const names = caps?.engines ? Object.keys(caps.engines) : [];
  state.engines = caps?.engines
    ? SERVING_ENGINES.filter((name) => names.includes(name))
    : servingEngines(Object.values(state.data.nodes));
}

function renderAll() {
  const instances = Object.values(state.data.instances);
  $("node-count").textContent = Object.keys(state.data.nodes).length;
  $("ready-count").textContent = instances.filter((i) => i.status === "ready").length;
  $("engine-list").textContent = servingEngines(Object.values(state.data.nodes)).join(", ") || "none";
  renderTopology();
  renderModels();
  fillSelect($("metrics-node"), Object.keys(state.data.nodes));
}

// ---------- topology ----------
// NodeInfo.kind (fleet_proto.common.NodeKind): "apple", "cuda" (NVIDIA GPUs) or "cpu".
export function deviceKind(node) {
  const kind = String(node.kind || "").toLowerCase();
  const chip = String(node.chip || "");
  if (chip.includes("Spark")) return { key: "spark", label: "DGX Spark" };
  if (kind === "apple" || node.system === "Darwin") return { key: "apple", label: "Apple Mac" };
  if (kind === "cuda") return { key: "nvidia", label: "NVIDIA GPU" };
  return { key: "cpu", label: kind && kind !== "cpu" ? kind : "Linux / CPU" };
}

function deviceIcon(kind) {
  const icon = svg("svg", { viewBox: "0 0 48 32", class: `icon icon-${kind.key}`, role: "img", "aria-label": kind.label });
  const shapes = {
    apple: [["rect", { x: 8, y: 3, width: 32, height: 21, rx: 2 }], ["rect", { x: 3, y: 25, width: 42, height: 4, rx: 2 }]],
    gpu: [["rect", { x: 3, y: 6, width: 42, height: 20, rx: 2 }], ["circle", { cx: 16, cy: 16, r: 6 }], ["circle", { cx: 32, cy: 16, r: 6 }]],
    cpu: [["rect", { x: 6, y: 3, width: 36, height: 11, rx: 2 }], ["rect", { x: 6, y: 18, width: 36, height: 11, rx: 2 }]],
  };
  const key = kind.key === "apple" ? "apple" : kind.key === "cpu" ? "cpu" : "gpu";
  icon.append(...shapes[key].map(([tag, attrs]) => svg(tag, attrs)));
  return icon;
}

function memoryBar(node, live) {
  const total = node.memory_total_bytes || 0;
  // The live sample's figure when the node reports one, else what it said when it joined.
  const free = live?.memory_available_bytes ?? node.memory_available_bytes ?? 0;
  const used = total > 0 ? Math.min(1, Math.max(0, (total - free) / total)) : 0;
  const fill = el("div", { className: "memory-fill" });
  fill.style.width = `${(used * 100).toFixed(1)}%`;
  return el("div", { className: "memory" },
    el("div", { className: "memory-bar", role: "meter", "aria-valuemin": 0, "aria-valuemax": 100,
      "aria-valuenow": Math.round(used * 100), "aria-label": "memory used" }, fill),
    el("p", { className: "memory-text" }, `${gib(free)} free of ${gib(total)}`));
}

// One line for a decoder's prefill partners (GET /state's "partners"), or null when it has none.
export function partnersText(partners) {
  if (!Array.isArray(partners) || !partners.length) return null;
  return `prefill partners: ${partners.map((p) => `${p.instance_id} (${p.engine || "?"})`).join(", ")}`;
}

function partnersLine(inst) {
  const partners = state.data.partners?.[inst.instance_id];
  const text = partnersText(partners);
  if (!text) return null;
  const why = partners.map((p) => `${p.instance_id}: ${p.model_id || ""} ${p.why ? `(${p.why})` : ""}`.trim());
  return el("span", { className: "instance-partners", title: why.join("\n"),
    "data-partners": partners.map((p) => p.instance_id).join(" ") }, text);
}

function instanceItem(inst, withDelete) {
  let status = inst.status || "unknown";
  // A worker pulling the model's files (downloading) or loading its layers reports how far it is.
  const inProgress = status === "loading" || status === "downloading";
  if (inProgress && typeof inst.progress === "number") status += ` ${Math.round(inst.progress * 100)}%`;
  const item = el("li", { className: "instance", "data-instance-id": inst.instance_id,
    "data-status": inst.status || "", "data-model-id": inst.model_id || "" },
  el("span", { className: "instance-model" }, inst.model_id),
  el("span", { className: "instance-meta" }, `${inst.engine || "?"} · ${inst.role || "both"} · ${inst.node_id || "unplaced"}`),
  el("span", { className: `badge status-${inst.status}` }, status));
  if (inst.reason) item.append(el("span", { className: "instance-reason" }, inst.reason));
  const partners = partnersLine(inst);
  if (partners) item.append(partners);
  if (withDelete) item.append(deleteButton(inst.instance_id));
  return item;
}

function createNodeCard(id) {
  return el("article", { className: "node panel", "data-node-id": id });
}

function gpuUtilization(live) {
  const reported = (live?.gpus || []).map((g) => g.utilization_ratio).filter((u) => u >= 0);
  return reported.length ? `${Math.round((reported.reduce((a, b) => a + b, 0) / reported.length) * 100)}%` : null;
}

function fillNodeCard(card, node, instances) {
  const live = state.live[node.node_id];
  const kind = deviceKind(node);
  const engines = (node.engines || []).map((e) => `${e.name} ${e.version || ""}`.trim()).join(", ");
  const gpus = (node.gpus || []).map((g) => `${g.name} (${gib(g.memory_bytes)})`).join(", ");
  card.className = `node panel kind-${kind.key}`;
  card.replaceChildren(
    el("header", { className: "node-head" }, deviceIcon(kind),
      el("div", {}, el("h3", { className: "node-id" }, node.node_id),
        el("p", { className: "muted" }, `${kind.label} · ${node.hostname || ""}`))),
    facts([["Chip", node.chip || node.machine], ["CPUs", node.cpu_count], gpus && ["GPUs", gpus],
      ["Engines", engines || null], live && ["CPU load", `${Math.round(live.cpu_percent)}%`],
      gpuUtilization(live) && ["GPU util", gpuUtilization(live)]]),
    memoryBar(node, live),
    el("h4", {}, "Instances"),
    instances.length ? el("ul", { className: "instances" }, instances.map((i) => instanceItem(i, false)))
      : el("p", { className: "muted" }, "none"));
}

function renderTopology() {
  const nodes = Object.values(state.data.nodes);
  const instances = Object.values(state.data.instances);
  const container = $("topology-nodes");
  const cards = nodes.map((node) => {
    const card = keyedCard(state.nodeCards, node.node_id, createNodeCard);
    fillNodeCard(card, node, instances.filter((i) => i.node_id === node.node_id));
    return card;
  });
  pruneCards(state.nodeCards, nodes.map((n) => n.node_id));
  // A connector between neighbouring cards stands in for the cluster links.
  const row = cards.flatMap((card, index) => (index ? [el("div", { className: "link", "aria-hidden": "true" }), card] : [card]));
  setChildren(container, row.length ? row : [el("p", { className: "muted" }, "No nodes have joined yet.")]);
  const others = instances.filter((i) => !state.data.nodes[i.node_id]);
  $("topology-other").hidden = others.length === 0;
  $("topology-other-list").replaceChildren(...others.map((i) => instanceItem(i, false)));
}

// ---------- models ----------
function modelUi(modelId) {
  state.modelUi[modelId] ??= { busy: {}, error: "", placements: null, placementError: "", scalingError: "",
    scalingEdited: false, scalingSaved: null };
  return state.modelUi[modelId];
}

async function withBusy(modelId, key, action) {
  const ui = modelUi(modelId);
  ui.busy[key] = true;
  renderModels();
  try { await action(ui); } finally { ui.busy[key] = false; renderModels(); }
}

function deleteButton(instanceId) {
  const button = el("button", { type: "button", className: "delete-instance" }, "Delete");
  button.addEventListener("click", async () => {
    button.disabled = true;
    await requestJSON("DELETE", `/instances/${encodeURIComponent(instanceId)}`).catch((err) => { button.title = err.message; });
    button.disabled = false;
    await refreshState();
  });
  return button;
}

function previewPlacements(modelId) {
  return withBusy(modelId, "preview", async (ui) => {
    const data = await requestJSON("GET", `/placements?model=${encodeURIComponent(modelId)}`)
      .catch((err) => ({ error: err.message }));
    ui.placements = data?.error ? null : data?.options || [];
    ui.placementError = data?.error || "";
  });
}

// POST /instances' body: the engine only when one was picked (else the scheduler picks), the role.
export function instanceBody(modelId, engine, role) {
  return { model: modelId, ...(engine ? { engine } : {}), role: role || "both" };
}

function createInstance(modelId, card) {
  const body = instanceBody(modelId, card.querySelector(".instance-engine").value,
    card.querySelector(".instance-role").value);
  return withBusy(modelId, "create", async (ui) => {
    ui.error = "";
    await requestJSON("POST", "/instances", body).catch((err) => { ui.error = err.message; });
    await refreshState();
  });
}

function downloadBlock(download) {
  const total = download.total_bytes || 0;
  const done = download.done_bytes || 0;
  let text = `${download.phase}: ${gib(done)} of ${gib(total)}`;
  if (download.bytes_per_s) text += ` · ${(download.bytes_per_s / 1024 ** 2).toFixed(1)} MiB/s`;
  if (download.eta_s) text += ` · ETA ${Math.round(download.eta_s)} s`;
  if (download.reason) text += ` · ${download.reason}`;
  return el("div", { className: "download-progress", "data-phase": download.phase },
    el("progress", { max: total || 1, value: total ? done : 0, "aria-label": `download of ${download.model_id}` }),
    el("span", { className: "download-text" }, text));
}

function placementRow(option) {
  const shards = (option.shards || []).map((s) => `${s.node_id} [${s.start_layer}–${s.end_layer})`).join(", ");
  const needed = Object.entries(option.memory_needed || {}).map(([node, bytes]) => `${node}: ${gib(bytes)}`).join(", ");
  const freeAfter = Object.entries(option.free_after || {}).map(([node, bytes]) => `${node}: ${gib(bytes)}`).join(", ");
  return el("li", { className: `placement ${option.feasible ? "feasible" : "infeasible"}`, "data-feasible": String(!!option.feasible) },
    el("strong", {}, option.engine),
    el("span", {}, shards || "no shards"),
    el("span", { className: "placement-verdict" }, option.feasible ? "feasible" : `not feasible: ${option.reason || "unknown"}`),
    el("span", {}, `needs ${needed || "—"}`),
    el("span", {}, `free after ${freeAfter || "—"}`),
    typeof option.score === "number" ? el("span", { className: "muted" }, `score ${option.score.toFixed(2)}`) : null);
}

// The engines and weight formats each node measured on a model: speed, and quality against the
// float32 reference with the node's budget verdict (the rule of fleet_proto.quality.within_budget).
function measuredRow(node, c) {
  const q = c.quality;
  const budget = node.quality_budget || {};
  const inside = !q || (q.top1_agreement >= budget.min_top1_agreement && q.mean_kl <= budget.max_mean_kl);
  const verdict = !q ? "quality not measured" : inside ? "within the quality budget" : "outside the quality budget";
  return el("li", { className: `measured ${inside ? "feasible" : "infeasible"}`, "data-engine": c.engine, "data-within": String(inside) },
    el("strong", {}, c.weight_format ? `${c.engine} / ${c.weight_format}` : c.engine),
    el("span", {}, node.node_id),
    el("span", {}, `prefill ${c.prefill_tokens_per_s.toFixed(0)} tok/s, decode ${c.decode_tokens_per_s.toFixed(1)} tok/s`),
    q ? el("span", {}, `top-1 ${q.top1_agreement.toFixed(3)}, KL ${q.mean_kl.toFixed(4)}, greedy ${q.greedy_agreement.toFixed(2)}`) : null,
    c.peak_memory_bytes ? el("span", {}, `peak ${gib(c.peak_memory_bytes)}`) : null,
    el("span", { className: "placement-verdict" }, verdict));
}

function measuredBlock(modelId) {
  const rows = Object.values(state.data.nodes).flatMap((node) =>
    (node.calibrations || []).filter((c) => c.model_id === modelId).map((c) => measuredRow(node, c)));
  return rows.length ? el("ul", { className: "placements", "aria-label": "measured engines" }, rows) : null;
}

function placementsBlock(ui) {
  if (ui.placementError) return el("p", { className: "model-error placement-error", role: "alert" }, ui.placementError);
  if (!ui.placements) return null;
  if (!ui.placements.length) return el("p", { className: "muted" }, "No placement options.");
  return el("ul", { className: "placements" }, ui.placements.map(placementRow));
}

// ---------- autoscaling (fleet_proto.scaling: a model's policy and its latest decisions) ----------
// A model id has slashes (org/name): each segment is encoded, the route takes the rest of the path.
export function scalingUrl(modelId) {
  return `/scaling/${modelId.split("/").map(encodeURIComponent).join("/")}`;
}

// PUT /scaling/<model>'s body from the form: the bounds, enabled (the rest keeps the current policy).
export function scalingBody(minInstances, maxInstances) {
  return { min_instances: Number(minInstances), max_instances: Number(maxInstances), enabled: true };
}

// The policy's bounds and the targets that are signals (a 0 target is not one), in words.
export function policyText(policy) {
  if (!policy) return "off";
  const bounds = `${policy.min_instances} to ${policy.max_instances} instances`;
  const targets = [
    policy.target_utilization ? `utilization ${Math.round(policy.target_utilization * 100)}%` : null,
    policy.target_queued_tokens ? `queue ${policy.target_queued_tokens} tokens` : null,
    policy.target_ttft_p90_s ? `TTFT p90 ${policy.target_ttft_p90_s} s` : null,
  ].filter(Boolean).join(", ");
  return `${policy.enabled ? "on" : "off"} · ${bounds}${targets ? ` · targets ${targets}` : ""}`;
}

// The policy's windows and delays, for the policy line's tooltip.
function policyTiming(policy) {
  if (!policy) return null;
  return [`up after ${policy.scale_up_window_s} s over target, then ${policy.scale_up_cooldown_s} s cooldown`,
    `down when demand fits at ${Math.round(policy.scale_down_ratio * 100)}% of the targets for ${policy.scale_down_delay_s} s`,
    `to ${policy.min_instances} after ${policy.idle_s} s idle`].join("\n");
}

function decisionItem(decision) {
  const at = decision.at ? new Date(decision.at * 1000) : null;
  return el("li", { className: "decision", "data-kind": decision.kind, "data-instance-id": decision.instance_id || null },
    el("span", { className: `badge decision-${decision.kind}` }, decision.kind),
    decision.instance_id ? el("span", { className: "decision-instance" }, decision.instance_id) : null,
    el("span", { className: "decision-reason" }, decision.reason || ""),
    at ? el("time", { className: "muted", datetime: at.toISOString() }, at.toLocaleTimeString()) : null);
}

function scalingBlock(modelId) {
  const scaling = state.data.scaling[modelId];
  const policy = scaling?.policy;
  const decisions = [...(scaling?.decisions || [])].reverse(); // the State keeps newest last
  return el("div", { className: "scaling", "data-enabled": String(!!policy?.enabled),
    "data-min": policy?.min_instances ?? null, "data-max": policy?.max_instances ?? null },
  el("h4", {}, "Autoscaling"),
  el("p", { className: "scaling-policy", title: policyTiming(policy) }, policyText(policy)),
  decisions.length ? el("ul", { className: "decisions", "aria-label": `scaling decisions for ${modelId}` },
    decisions.map(decisionItem)) : null);
}

function saveScaling(modelId, card) {
  const body = scalingBody(card.querySelector(".scaling-min").value, card.querySelector(".scaling-max").value);
  return withBusy(modelId, "scaling", async (ui) => {
    ui.scalingError = "";
    await requestJSON("PUT", scalingUrl(modelId), body)
      .then(() => { ui.scalingSaved = body; })
      .catch((err) => { ui.scalingError = err.message; });
    await refreshState();
  });
}

function disableScaling(modelId) {
  return withBusy(modelId, "scaling", async (ui) => {
    ui.scalingError = "";
    await requestJSON("DELETE", scalingUrl(modelId)).catch((err) => { ui.scalingError = err.message; });
    await refreshState();
  });
}

function scalingForm(id) {
  const number = (className, min, label) => el("input", { type: "number", className, min, step: 1, required: true,
    "aria-label": `${label} instances for ${id}` });
  const form = el("form", { className: "actions scaling-form", "aria-label": `autoscaling for ${id}` },
    el("label", { className: "instance-option" }, "min ", number("scaling-min", 0, "minimum")),
    el("label", { className: "instance-option" }, "max ", number("scaling-max", 1, "maximum")),
    el("button", { type: "submit", className: "scaling-save" }, "Enable"),
    el("button", { type: "button", className: "scaling-disable" }, "Disable"));
  // Typed values stay until saved: the live refreshes only fill the fields while they are untouched.
  form.addEventListener("input", () => { modelUi(id).scalingEdited = true; });
  return form;
}

function fillScalingForm(form, modelId, instances) {
  const ui = modelUi(modelId);
  const policy = state.data.scaling[modelId]?.policy;
  // A saved policy shows once the scheduler recorded it (scaling_policy_set); until then the form keeps it.
  const saved = ui.scalingSaved;
  if (saved && policy?.enabled && policy.min_instances === saved.min_instances && policy.max_instances === saved.max_instances) {
    ui.scalingEdited = false;
    ui.scalingSaved = null;
  }
  if (!ui.scalingEdited) {
    form.querySelector(".scaling-min").value = policy?.min_instances ?? 1;
    form.querySelector(".scaling-max").value = policy?.max_instances ?? Math.max(1, instances.length);
  }
  form.querySelector(".scaling-save").textContent = policy?.enabled ? "Update" : "Enable";
  form.querySelector(".scaling-save").disabled = !!ui.busy.scaling;
  form.querySelector(".scaling-disable").disabled = !!ui.busy.scaling || !policy?.enabled;
}

function createModelCard(id) {
  const preview = el("button", { type: "button", className: "preview-placements" }, "Preview placements");
  const create = el("button", { type: "button", className: "create-instance" }, "Create instance");
  const engine = el("select", { className: "instance-engine", "aria-label": `engine for ${id}` });
  const role = el("select", { className: "instance-role", "aria-label": `role for ${id}` },
    INSTANCE_ROLES.map((r) => el("option", { value: r }, r)));
  const card = el("article", { className: "model-card panel", "data-model-id": id },
    el("h3", { className: "model-id" }, id), el("div", { className: "model-body" }),
    el("div", { className: "actions" }, preview,
      el("label", { className: "instance-option" }, "engine ", engine),
      el("label", { className: "instance-option" }, "role ", role), create),
    el("div", { className: "model-scaling" }), scalingForm(id),
    el("div", { className: "model-extra" }));
  preview.addEventListener("click", () => previewPlacements(id));
  card.querySelector(".scaling-form").addEventListener("submit", (e) => { e.preventDefault(); saveScaling(id, card); });
  card.querySelector(".scaling-disable").addEventListener("click", () => disableScaling(id));
  create.addEventListener("click", () => createInstance(id, card));
  return card;
}

function fillModelCard(card, model, instances, download) {
  const ui = modelUi(model.model_id);
  const quant = [model.dtype, model.quantization].filter(Boolean).join(" / ");
  card.querySelector(".preview-placements").disabled = !!ui.busy.preview;
  card.querySelector(".create-instance").disabled = !!ui.busy.create;
  fillSelect(card.querySelector(".instance-engine"), ["", ...state.engines], ["auto", ...state.engines]);
  card.querySelector(".model-body").replaceChildren(...[
    facts([["Architecture", model.architecture], ["Type", quant || null], ["Size", gib(model.storage_bytes)],
      ["Layers", model.num_layers], ["Engines", (model.supported_engines || []).join(", ") || null]]),
    download ? downloadBlock(download) : null,
    measuredBlock(model.model_id),
    instances.length ? el("ul", { className: "instances" }, instances.map((i) => instanceItem(i, true))) : null,
  ].filter(Boolean));
  card.querySelector(".model-scaling").replaceChildren(scalingBlock(model.model_id));
  fillScalingForm(card.querySelector(".scaling-form"), model.model_id, instances);
  card.querySelector(".model-extra").replaceChildren(...[
    ui.error ? el("p", { className: "model-error", role: "alert" }, ui.error) : null,
    ui.scalingError ? el("p", { className: "model-error scaling-error", role: "alert" }, ui.scalingError) : null,
    placementsBlock(ui),
  ].filter(Boolean));
}

function renderModels() {
  const models = Object.values(state.data.models);
  const instances = Object.values(state.data.instances);
  const downloads = state.data.downloads;
  const cards = models.map((m) => {
    const card = keyedCard(state.modelCards, m.model_id, createModelCard);
    fillModelCard(card, m, instances.filter((i) => i.model_id === m.model_id), downloads[m.model_id]);
    return card;
  });
  pruneCards(state.modelCards, models.map((m) => m.model_id));
  setChildren($("model-list"), cards.length ? cards : [el("p", { className: "muted" }, "No models staged.")]);
}

// ---------- metrics ----------
function fillSelect(select, values, labels = values) {
  const previous = select.value;
  const current = [...select.options].map((o) => o.value);
  if (current.length === values.length && current.join("\n") === values.join("\n")) return;
  select.replaceChildren(...values.map((v, i) => el("option", { value: v }, labels[i])));
  if (values.includes(previous)) select.value = previous;
}

async function loadMetricNames() {
  if (state.metricNames.length) return;
  const data = await requestJSON("GET", "/dashboard/metrics").catch(() => null); // retried on the next refresh
  state.metricNames = data?.metrics || [];
  fillSelect($("metrics-metric"), state.metricNames);
}

function formatMetric(metric, value) {
  if (metric.includes("bytes")) return gib(value);
  return Math.abs(value) >= 100 ? value.toFixed(0) : value.toFixed(2);
}

async function refreshMetrics() {
  if (currentView !== "metrics") return;
  await loadMetricNames();
  const node = $("metrics-node").value;
  const metric = $("metrics-metric").value;
  if (!node || !metric) { drawPlot([], metric || ""); return; }
  const query = new URLSearchParams({ node, metric, window: $("metrics-window").value });
  const points = await requestJSON("GET", `/dashboard/series?${query}`).catch(() => []);
  if (currentView === "metrics") drawPlot(Array.isArray(points) ? points.slice(-600) : [], metric, node);
}

function drawPlot(points, metric, node = "") {
  const plot = $("metrics-plot");
  const [width, height, left, right, top, bottom] = [720, 280, 80, 12, 14, 30];
  plot.dataset.points = String(points.length);
  plot.setAttribute("aria-label", points.length ? `${metric} on ${node}, ${points.length} points` : "no data yet");
  plot.replaceChildren(svg("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" }),
    svg("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" }));
  if (!points.length) {
    plot.append(svg("text", { x: width / 2, y: height / 2, class: "empty", "text-anchor": "middle" }, "no data yet"));
    return;
  }
  const ts = points.map((p) => p[0]);
  const vs = points.map((p) => p[1]);
  const [t0, t1] = [Math.min(...ts), Math.max(...ts)];
  let [v0, v1] = [Math.min(...vs), Math.max(...vs)];
  if (v0 === v1) { v0 -= 1; v1 += 1; }
  const x = (t) => left + (t1 === t0 ? 0.5 : (t - t0) / (t1 - t0)) * (width - left - right);
  const y = (v) => height - bottom - ((v - v0) / (v1 - v0)) * (height - top - bottom);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();
  plot.append(
    svg("text", { x: left - 6, y: top + 10, class: "label", "text-anchor": "end" }, formatMetric(metric, v1)),
    svg("text", { x: left - 6, y: height - bottom, class: "label", "text-anchor": "end" }, formatMetric(metric, v0)),
    svg("text", { x: left, y: height - 8, class: "label" }, clock(t0)),
    svg("text", { x: width - right, y: height - 8, class: "label", "text-anchor": "end" }, clock(t1)),
    svg("polyline", { class: "series", points: points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ") }));
  plot.append(...points.map(([t, v]) => svg("circle", { class: "point", cx: x(t).toFixed(1), cy: y(v).toFixed(1), r: 2 })));
}

// ---------- chat ----------
async function refreshChatModels() {
  const data = await requestJSON("GET", "/v1/models").catch(() => null);
  if (data) fillSelect($("chat-model"), (data.data || []).map((m) => m.id));
}

function appendTurn(text) {
  const log = $("chat-log");
  const reasoning = el("details", { className: "reasoning", hidden: true },
    el("summary", {}, "Reasoning"), el("div", { className: "reasoning-text" }));
  const assistant = el("div", { className: "message assistant", "data-done": "false" },
    reasoning, el("div", { className: "answer" }));
  log.append(el("div", { className: "message user" }, text), assistant);
  log.scrollTop = log.scrollHeight;
  return assistant;
}

function chatStatsText(stats) {
  const now = performance.now();
  if (stats.firstAt === null && stats.endAt === null) {
    const done = stats.prefill ? ` ${stats.prefill.processed_tokens}/${stats.prefill.total_tokens} tokens,` : "";
    return `prefilling…${done} ${((now - stats.start) / 1000).toFixed(1)} s`;
  }
  const first = stats.firstAt ?? stats.endAt;
  const ttft = (first - stats.start) / 1000;
  const decode = ((stats.endAt ?? now) - first) / 1000;
  const tokens = stats.usage?.completion_tokens ?? stats.deltas;
  const rate = decode > 0 ? (tokens / decode).toFixed(1) : "—";
  const prompt = stats.usage?.prompt_tokens ?? "—";
  return `TTFT ${ttft.toFixed(2)} s · ${rate} tok/s · ${tokens} tokens · prompt ${prompt} tokens`;
}

function applyChunk(chunk, assistant, stats) {
  if (chunk.error) throw new Error(chunk.error.message || "stream error");
  if (chunk.usage) stats.usage = chunk.usage;
  const delta = chunk.choices?.[0]?.delta || {};
  if (delta.reasoning_content) {
    const details = assistant.querySelector(".reasoning");
    details.hidden = false;
    details.querySelector(".reasoning-text").append(delta.reasoning_content);
  }
  if (delta.content) assistant.querySelector(".answer").append(delta.content);
  if (delta.content || delta.reasoning_content) {
    stats.firstAt ??= performance.now();
    stats.deltas += 1;
  }
}

// The gateway's prefill progress on an SSE stream: a comment line, so other clients skip it.
const PROGRESS_COMMENT = ": prefill_progress ";

// Returns true once [DONE] is seen.
function handleSseEvent(block, assistant, stats) {
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith(PROGRESS_COMMENT)) stats.prefill = JSON.parse(line.slice(PROGRESS_COMMENT.length));
    if (!line.startsWith("data:")) continue;
    const payload = line.slice(5).trim();
    if (payload === "[DONE]") return true;
    if (payload) applyChunk(JSON.parse(payload), assistant, stats);
  }
  return false;
}

async function streamReply(model, messages, assistant, stats, signal) {
  const res = await authorizedFetch("/v1/chat/completions", {
    method: "POST", signal, headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model, messages, stream: true,
      stream_options: { include_usage: true }, max_tokens: 256 }),
  });
  if (!res.ok) throw new Error(errorMessage(await readJSON(res), res.status));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    const blocks = buffer.split(/\r?\n\r?\n/);
    buffer = done ? "" : blocks.pop();
    for (const block of blocks) if (handleSseEvent(block, assistant, stats)) return;
    if (done) return;
  }
}

function showChatError(assistant, message) {
  assistant.classList.add("error");
  assistant.append(el("p", { className: "error-text", role: "alert" }, message));
}

async function sendChat() {
  const input = $("chat-input");
  const text = input.value.trim();
  const model = $("chat-model").value;
  if (state.chat.busy || !text) return;
  const assistant = appendTurn(text);
  if (!model) {
    showChatError(assistant, "No ready model to chat with.");
    assistant.dataset.done = "true";
    return;
  }
  input.value = "";
  const messages = state.chat.messages; // a Clear during the stream starts a new array; leave it alone
  messages.push({ role: "user", content: text });
  state.chat.busy = true;
  state.chat.abort = new AbortController();
  $("chat-send").disabled = true;
  const stats = { start: performance.now(), firstAt: null, endAt: null, deltas: 0, usage: null, prefill: null };
  const showStats = () => { $("chat-stats").textContent = chatStatsText(stats); };
  showStats();
  const ticker = setInterval(showStats, 200);
  try {
    await streamReply(model, messages, assistant, stats, state.chat.abort.signal);
    messages.push({ role: "assistant", content: assistant.querySelector(".answer").textContent });
  } catch (err) {
    messages.pop(); // drop the unanswered user turn so the history stays well-formed
    showChatError(assistant, err.name === "AbortError" ? "cancelled" : err.message);
  } finally {
    stats.endAt = performance.now();
    clearInterval(ticker);
    $("chat-stats").textContent = chatStatsText(stats);
    assistant.dataset.done = "true";
    state.chat.busy = false;
    $("chat-send").disabled = false;
  }
}

function clearChat() {
  state.chat.abort?.abort();
  state.chat.messages = [];
  $("chat-log").replaceChildren();
  $("chat-stats").textContent = "";
}

// ---------- traces ----------
const NS_PER_MS = 1e6;
const MIN_BAR_PERCENT = 0.3; // a span of a few microseconds still shows as a sliver

const ms = (ns) => {
  const value = ns / NS_PER_MS;
  return value >= 100 ? `${value.toFixed(0)} ms` : value >= 1 ? `${value.toFixed(1)} ms` : `${value.toFixed(3)} ms`;
};

// The spans in timeline order: each span right after its parent, siblings by start time, with its depth.
// Spans whose parent is not in the trace (the root, or a service that did not report) start the tree.
export function spanRows(spans) {
  const ids = new Set(spans.map((s) => s.span_id));
  const children = new Map();
  for (const span of spans) {
    const parent = ids.has(span.parent_id) ? span.parent_id : "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(span);
  }
  for (const list of children.values()) list.sort((a, b) => a.start_ns - b.start_ns || b.end_ns - a.end_ns);
  const rows = [];
  const visit = (parent, depth) => {
    for (const span of children.get(parent) || []) {
      rows.push({ span, depth });
      visit(span.span_id, depth + 1);
    }
  };
  visit("", 0);
  return rows;
}

// Where a span's bar sits on the trace's time axis, in percent of the trace (start t0, length total).
export function barGeometry(span, t0, total) {
  if (total <= 0) return { left: 0, width: 100 };
  const left = Math.min(100, Math.max(0, ((span.start_ns - t0) / total) * 100));
  const width = Math.max(MIN_BAR_PERCENT, Math.min(100 - left, ((span.end_ns - span.start_ns) / total) * 100));
  return { left: Math.min(left, 100 - width), width };
}

function spanTitle(span) {
  const attributes = Object.entries(span.attributes || {}).map(([k, v]) => `${k}=${v}`);
  return [`${span.name} (${span.service}${span.service_id ? ` ${span.service_id}` : ""})`,
    `${ms(span.end_ns - span.start_ns)}`, ...attributes, span.error ? `error: ${span.error}` : null]
    .filter(Boolean).join("\n");
}

function timelineRow({ span, depth }, t0, total) {
  const { left, width } = barGeometry(span, t0, total);
  const title = spanTitle(span);
  const bar = el("div", { className: "trace-bar", "data-span-id": span.span_id, "data-category": span.category,
    "data-service": span.service, "data-error": span.error ? "true" : "false", title });
  bar.style.left = `${left.toFixed(2)}%`;
  bar.style.width = `${width.toFixed(2)}%`;
  const label = el("div", { className: "trace-label", title },
    el("span", { className: "trace-name" }, span.name),
    el("span", { className: "trace-service muted" }, span.service));
  label.style.paddingLeft = `${depth * 0.9}rem`;
  return el("div", { className: "trace-row" }, label,
    el("div", { className: "trace-track" }, bar),
    el("div", { className: "trace-duration muted" }, ms(span.end_ns - span.start_ns)));
}

function renderTimeline(traceId, spans) {
  const timeline = $("trace-timeline");
  timeline.dataset.traceId = traceId;
  if (!spans.length) {
    timeline.replaceChildren(el("p", { className: "muted" }, "This trace has no spans."));
    return;
  }
  const t0 = Math.min(...spans.map((s) => s.start_ns));
  const total = Math.max(...spans.map((s) => s.end_ns)) - t0;
  const axis = el("div", { className: "trace-row trace-axis muted" }, el("div", { className: "trace-label" }, "span"),
    el("div", { className: "trace-track" }, el("span", {}, "0"), el("span", { className: "trace-axis-end" }, ms(total))),
    el("div", { className: "trace-duration" }, "time"));
  timeline.replaceChildren(axis, ...spanRows(spans).map((row) => timelineRow(row, t0, total)));
}

function renderTraceStats(stats) {
  const table = $("trace-stats");
  table.hidden = !stats;
  if (!stats) return;
  table.querySelector("tbody").replaceChildren(...stats.categories.map((c) =>
    el("tr", { "data-category": c.category },
      el("th", { scope: "row" }, el("span", { className: "swatch", "data-category": c.category }), c.category),
      el("td", {}, c.count), el("td", {}, ms(c.self_ns)), el("td", {}, `${(c.share * 100).toFixed(1)}%`))));
}

async function showTrace(traceId) {
  state.traces.selected = traceId;
  for (const item of $("trace-list").children) {
    if (item.dataset.traceId === traceId) item.setAttribute("aria-current", "true");
    else item.removeAttribute("aria-current");
  }
  try {
    const [trace, stats] = await Promise.all([
      requestJSON("GET", `/v1/traces/${encodeURIComponent(traceId)}`),
      requestJSON("GET", `/v1/traces/${encodeURIComponent(traceId)}/stats`),
    ]);
    if (state.traces.selected !== traceId) return; // another trace was picked meanwhile
    renderTimeline(traceId, trace.spans || []);
    renderTraceStats(stats);
  } catch (err) {
    $("trace-timeline").replaceChildren(el("p", { className: "model-error", role: "alert" }, err.message));
    renderTraceStats(null);
  }
}

function traceItem(summary) {
  const when = new Date(summary.start_ns / NS_PER_MS).toLocaleTimeString();
  const button = el("button", { type: "button", className: "trace-pick" },
    el("span", { className: "trace-name" }, summary.name),
    el("span", { className: "muted" }, `${when} · ${ms(summary.duration_ns)} · ${summary.spans} spans`),
    el("span", { className: "muted" }, summary.services.join(", ")),
    summary.error ? el("span", { className: "badge status-failed" }, "error") : null);
  button.addEventListener("click", () => showTrace(summary.trace_id));
  return el("li", { className: "trace-item", "data-trace-id": summary.trace_id,
    "aria-current": summary.trace_id === state.traces.selected ? "true" : null }, button);
}

async function refreshTraces() {
  if (currentView !== "traces") return;
  let data;
  try {
    data = await requestJSON("GET", "/v1/traces?limit=100");
  } catch (err) {
    $("traces-status").textContent = err.message;
    return;
  }
  const traces = data?.data || [];
  $("traces-status").textContent = traces.length ? `${traces.length} recent requests` : "";
  const json = JSON.stringify(traces);
  if (json === state.traces.lastJson) return; // keep the list (and a focused button) as it is
  state.traces.lastJson = json;
  $("trace-list").replaceChildren(...(traces.length ? traces.map(traceItem)
    : [el("li", { className: "muted" }, "No traces yet: send a request (the Chat view does).")]));
}

// ---------- wiring ----------
function wireUi() {
  for (const b of document.querySelectorAll(".nav button")) b.addEventListener("click", () => showView(b.dataset.view));
  for (const id of ["metrics-node", "metrics-metric", "metrics-window"]) $(id).addEventListener("change", refreshMetrics);
  $("metrics-controls").addEventListener("submit", (e) => e.preventDefault());
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); sendChat(); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendChat(); }
  });
  $("chat-clear").addEventListener("click", clearChat);
  $("traces-refresh").addEventListener("click", refreshTraces);
}

function start() {
  wireUi();
  showView("topology");
  refreshState();
  connectEvents();
  setInterval(refreshState, 5000);
  setInterval(refreshMetrics, 2000);
  setInterval(refreshLive, 2000);
  setInterval(refreshTraces, 3000);
}

start();
