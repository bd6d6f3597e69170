// keygate console: polls the admin API and redraws. Text goes in with textContent only.
"use strict";

// ?interval=MS, at least 100 ms; anything else (not a number, 0, negative) is the default.
const ASKED_MS = Number(new URLSearchParams(location.search).get("interval"));
const POLL_MS = Number.isFinite(ASKED_MS) && ASKED_MS > 0 ? Math.max(100, ASKED_MS) : 1000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function selectedQueue() {
  const match = /(?:^|&)queue=([^&]+)/.exec(location.hash.slice(1));
  return match ? decodeURIComponent(match[1]) : null;
}

async function getJson(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).message || message; } catch (e) { /* not JSON */ }
    throw new Error(`${path}: ${response.status} ${message}`);
  }
  return response.json();
}

function drawQueues(queues) {
  const body = document.querySelector("#queues tbody");
  const selected = selectedQueue();
  body.replaceChildren(...queues.map((q) => {
    const row = el("tr", { class: q.name === selected ? "queue selected" : "queue",
                           "data-queue": q.name },
      el("td", {}, q.name), el("td", {}, q.partitions), el("td", {}, q.depth),
      el("td", {}, q.bytes), el("td", {}, q.in_flight), el("td", {}, q.dead_letters));
    row.addEventListener("click", () => { location.hash = "queue=" + encodeURIComponent(q.name); });
    return row;
  }));
}

function partitionTile(p) {
  const owner = p.owner_client || (p.owner_flow ? p.owner_flow.slice(0, 8) : "—");
  return el("div", { class: `partition state-${p.state}`, "data-partition": p.partition,
                     "data-state": p.state, "data-owner": p.owner_client || "" },
    el("div", { class: "name" }, `P${p.partition} · ${p.state}`),
    el("div", { class: "owner", title: owner }, owner),
    el("div", {}, `backlog ${p.backlog} · lag ${p.lag}`),
    el("div", {}, `in flight ${p.in_flight} · done ≤ ${p.committed_seq}`));
}

function flowTable(flows) {
  if (!flows.length) return el("p", { class: "hint" }, "no consumer bound");
  return el("table", { class: "flows" },
    el("thead", {}, el("tr", {}, ...["client", "flow", "state", "ack", "window", "pending",
                                      "partitions"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...flows.map((f) => el("tr", { "data-flow": f.flow_id },
      el("td", {}, f.client), el("td", {}, f.flow_id.slice(0, 8)), el("td", {}, f.state),
      el("td", {}, f.ack_mode), el("td", {}, f.window), el("td", {}, f.pending),
      el("td", {}, f.partitions.join(" "))))));
}

function keyTable(keys) {
  if (!keys || !keys.length) return el("p", { class: "hint" }, "every key is flowing");
  return el("table", { class: "keys" },
    el("thead", {}, el("tr", {}, ...["partition", "key", "held back", "detail", "attempts",
                                      "since"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...keys.map((k) => el("tr", { "data-key": k.key ?? "", "data-reason": k.reason },
      el("td", {}, k.partition), el("td", {}, k.key ?? "(keys of the partition)"),
      el("td", {}, k.reason), el("td", {}, k.detail ?? ""), el("td", {}, k.attempts ?? ""),
      el("td", {}, k.blocked_since ? new Date(k.blocked_since * 1000).toLocaleTimeString() : "")))));
}

function drawDetail(data) {
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-name").textContent = data.queue.name;
  const groups = data.groups.map((g) => el("div", { class: "group", "data-group": g.group },
    el("h3", {}, `group ${g.group} (${g.mode}, key order ${g.key_order})`),
    el("div", { class: "map" }, ...g.partitions.map(partitionTile)),
    flowTable(g.flows),
    keyTable(g.keys)));
  document.getElementById("groups").replaceChildren(
    ...(groups.length ? groups : [el("p", { class: "hint" }, "no consumer group yet")]));
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    drawQueues(await getJson("/api/queues"));
    const queue = selectedQueue();
    if (queue) drawDetail(await getJson(`/api/queues/${encodeURIComponent(queue)}/inspect`));
    else document.getElementById("detail").hidden = true;
    status.className = "status";
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    status.className = "status error";
    status.textContent = String(error.message || error);
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

window.addEventListener("hashchange", refresh);
loop();
