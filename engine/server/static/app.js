// The mole game dashboard: plain JS, no build step. Everything a model or a user wrote is
// inserted as text (textContent / text nodes), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const PALETTE = ["#2f3a8f", "#0f7b6c", "#b45309", "#7c3aed", "#be185d", "#0369a1", "#4d7c0f", "#9f1239"];
const LIVE = new Set(["recording", "paused"]);
const SIGNALS = [
  ["tool_usage", "tools"], ["timing", "timing"], ["message_anomaly", "messages"],
  ["information_quality", "info"], ["llm", "llm"],
];

const S = {
  sid: null, stream: null, lastSeq: -1, seen: new Set(), events: [], agents: [], rounds: 0,
  status: null, controllable: false, suspect: null, verdict: null, stepsEl: new Map(),
  // stats: per agent, in an object without a prototype (an agent may be named
  // "constructor" or "__proto__")
  tools: [], stats: Object.create(null), sessionsOffset: 0, saveTimer: null,
  // gen: bumped whenever another session is opened, so that an answer or a stream of the
  // previous one is dropped; pending: a control requested and not yet seen in the stream;
  // busy: a control or an accusation on its way; branch: a branch is never accused
  gen: 0, pending: null, busy: false, branch: false, badgeKey: null,
  // streamOk: the live stream is connected (the dot shows only then); sessionsQueue: one
  // load of the sessions list at a time, in the order asked
  streamOk: false, sessionsQueue: Promise.resolve(),
  // unknown: the live stream stopped for good and the server did not say what became of the
  // run, so no control of it applies; forking, attributing: a fork or an attribution on its
  // way (of whichever session: its button is not offered twice)
  unknown: false, forking: false, attributing: false,
  // the runs this page went "unknown" for: their rows in the sessions list say so too, until
  // the server says what became of them (a sessions list or the run's detail answered)
  unknownRuns: new Set(),
};
// what the server sent, duplicates included: the browser tests read it
window.__car = { received: [], shown: [], resumedFrom: null, ends: 0, statsDrawn: 0, scrolled: 0 };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "style") node.setAttribute("style", v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

// A name (an agent's, the mole's, a suspect's) as the page shows it, told apart from every
// other name: what shows as nothing or as a blank (controls, zero-width and format characters,
// bidi marks, spaces other than U+0020, fillers, variation selectors), a space at either end
// and a backslash as a visible escape, so that no escape can be forged (engine/terminal.py does
// the same for the terminal).
const UNSEEN = /[\p{Cc}\p{Cf}\p{Zs}\p{Zl}\p{Zp}\u115f\u1160\u3164\uffa0\u2800\u034f\u17b4\u17b5\u180b-\u180d\u180f\ufe00-\ufe0f\u{e0100}-\u{e01ef}]/u;
function nameText(name) {
  const out = [];
  for (const ch of String(name ?? "")) {
    const o = ch.codePointAt(0);
    if (ch === "\\" || (ch !== " " && UNSEEN.test(ch))) {
      out.push(o < 0x100 ? `\\x${o.toString(16).padStart(2, "0")}`
        : o < 0x10000 ? `\\u${o.toString(16).padStart(4, "0")}` : `\\U${o.toString(16).padStart(8, "0")}`);
    } else out.push(ch);
  }
  if (out[0] === " ") out[0] = "\\x20";
  if (out.length > 1 && out[out.length - 1] === " ") out[out.length - 1] = "\\x20";
  return out.join("");
}

function colorOf(agent) {
  const i = S.agents.indexOf(agent);
  if (i >= 0) return PALETTE[i % PALETTE.length];
  let h = 0;
  for (const ch of String(agent)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return PALETTE[h % PALETTE.length];
}

function avatar(agent) {
  return el("span", { class: "avatar", style: `background:${colorOf(agent)}` },
    [...nameText(agent || "?")][0].toUpperCase());
}

let toastTimer = null;
function toast(message, isError) {
  const t = $("toast");
  t.textContent = message;
  t.className = "toast" + (isError ? " error" : "");
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, isError ? 6000 : 3000);
}

async function api(method, path, body) {
  const opts = { method, headers: {} };
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, opts);
  } catch (e) {
    return { ok: false, status: 0, data: { error: "the server is not reachable" } };
  }
  let data = null;
  try { data = await res.json(); } catch (e) { data = { error: res.statusText }; }
  return { ok: res.ok, status: res.status, data };
}

function fmtPct(x) { return x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`; }
function fmt3(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(3); }
function short(text, n) { text = String(text ?? ""); return text.length > n ? text.slice(0, n - 1) + "…" : text; }
// a count with its noun: "1 step", "2 steps", "0 branches"
function plural(n, one, many) { return `${n} ${Number(n) === 1 ? one : many || `${one}s`}`; }

// ------------------------------------------------------------------ sessions list

const SESSIONS_PAGE = 15;

// append: the next page ("Older sessions"); otherwise a refresh of what is shown, updated in
// place: the rows unfolded stay (up to 200 of them), new heists join the top, and a row keeps
// its element, so the keyboard focus and the scroll position stay where they were
function loadSessions(append) {
  const run = () => (append ? moreSessions() : refreshSessions());
  S.sessionsQueue = S.sessionsQueue.then(run, run);
  return S.sessionsQueue;
}

function sessionRows() {
  return [...$("sessions").children].filter((li) => li.dataset.session !== undefined);
}

async function refreshSessions() {
  const before = sessionRows();
  const shown = Math.max(SESSIONS_PAGE, before.length);
  const r = await api("GET", `/api/sessions?limit=${Math.min(200, shown + SESSIONS_PAGE)}&offset=0`);
  // a list that could not be refreshed says so: its statuses are as old as its last load
  sessionsNote(r.ok ? null : `The sessions list could not be refreshed: ${streamWords(r.status)}${r.status ? ` (HTTP ${r.status})` : ""}. The statuses shown may be out of date.`);
  if (!r.ok) return;
  let keep = r.data.sessions;
  for (const s of keep) if (!(S.unknown && s.session_id === S.sid)) S.unknownRuns.delete(s.session_id);
  // down to the oldest row shown before, wherever the heists started meanwhile put it
  const last = before.length ? before[before.length - 1].dataset.session : null;
  const i = keep.findIndex((s) => s.session_id === last);
  keep = i >= 0 ? keep.slice(0, i + 1) : keep.slice(0, shown);
  placeSessions(keep, before);
  S.sessionsOffset = keep.length;
  showMoreSessions(r.data.total);
}

async function moreSessions() {
  const r = await api("GET", `/api/sessions?limit=${SESSIONS_PAGE}&offset=${S.sessionsOffset}`);
  if (!r.ok) { toast(errorText(r, "could not load older sessions"), true); return; }
  const before = sessionRows();
  // heists started since the last load shift the pages: a row already shown is not repeated
  const have = new Set(before.map((li) => li.dataset.session));
  placeSessions(before.map((li) => li._session).concat(r.data.sessions.filter((s) => !have.has(s.session_id))), before);
  S.sessionsOffset += r.data.sessions.length;
  showMoreSessions(r.data.total);
}

function sessionsNote(text) {
  const note = $("sessions-note");
  note.textContent = text || "";
  note.hidden = !text;
  $("sessions").classList.toggle("stale", !!text);
}

function showMoreSessions(total) {
  $("more-sessions").hidden = S.sessionsOffset >= total;
  const list = $("sessions");
  const none = list.querySelector("li.none");
  if (!total && !none) list.append(el("li", { class: "muted small none" }, "No heists recorded yet."));
  if (total && none) none.remove();
}

// the list becomes exactly `sessions`, in that order, reusing the rows it has: a row is moved
// only when it is out of place (moving it would take the focus away from it)
function placeSessions(sessions, before) {
  const list = $("sessions");
  const rows = new Map(before.map((li) => [li.dataset.session, li]));
  let at = list.firstChild;
  for (const s of sessions) {
    let li = rows.get(s.session_id);
    rows.delete(s.session_id);
    if (!li) li = el("li", { dataset: { session: s.session_id } }, el("button", {
      type: "button", dataset: { session: s.session_id }, onclick: () => openSession(s.session_id),
    }));
    fillSessionRow(li, s);
    if (li !== at) list.insertBefore(li, at);
    else at = at.nextSibling;
  }
  for (const li of rows.values()) li.remove();
}

// the row of one session, filled again from what the list last said of it
function refillSessionRow(sid) {
  const li = sessionRows().find((row) => row.dataset.session === sid);
  if (li && li._session) fillSessionRow(li, li._session);
}

function fillSessionRow(li, s) {
  li._session = s;
  const btn = li.firstChild;
  btn.classList.toggle("current", s.session_id === S.sid);
  const when = new Date(s.created_at);
  const time = isNaN(when) ? "" : when.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  // what the page says of the run: a row does not claim a state the page no longer knows
  const status = S.unknownRuns.has(s.session_id) ? "unknown" : s.status;
  const key = JSON.stringify([status, s.steps, time, s.outcome ? !!s.outcome.bad : null]);
  if (btn._key === key) return;
  btn._key = key;
  const outcome = s.outcome ? (s.outcome.bad ? el("span", { class: "pill bad" }, "bad") : el("span", { class: "pill ok" }, "ok")) : null;
  const title = status === "unknown" ? UNKNOWN_TITLE : null;
  clear(btn);
  btn.append(
    el("span", { class: "row" }, el("code", {}, s.session_id), el("span", { class: `pill ${status}`, title }, status)),
    el("span", { class: "row muted small" }, el("span", {}, `${plural(s.steps, "step")} · ${time}`), outcome));
}

// ------------------------------------------------------------------ open a session

function storageKey(sid) { return `car.stream.${sid}`; }

function saveNow() {
  clearTimeout(S.saveTimer);
  S.saveTimer = null;
  if (!S.sid) return;
  // only a contiguous prefix is kept, so a reload resumes right after what it restores
  const events = S.events.length > 4000 ? [] : S.events;
  const lastSeq = events.length ? S.lastSeq : -1;
  try {
    sessionStorage.setItem(storageKey(S.sid), JSON.stringify({ lastSeq, events }));
  } catch (e) { /* storage full: a reload then replays the stream from the start */ }
}

function saveSoon() {
  if (!S.saveTimer) S.saveTimer = setTimeout(saveNow, 150);
}

function resetView() {
  if (S.stream) { S.stream.close(); S.stream = null; }
  S.streamOk = false;
  $("stream-note").hidden = true;
  Object.assign(S, { lastSeq: -1, seen: new Set(), events: [], agents: [], rounds: 0, status: null,
    controllable: false, suspect: null, verdict: null, stepsEl: new Map(), tools: [], stats: Object.create(null),
    gen: S.gen + 1, pending: null, busy: false, branch: false, badgeKey: null, unknown: false,
    scenario: null, renderQueued: false, statsQueued: false, scrollQueued: false });
  // nothing applies, and nothing of the previous session is shown, until the new session's
  // state is known: its status, progress and live dot would pass for the new one's
  syncButtons();
  syncLive();
  const pill = $("status");
  pill.hidden = true;
  pill.textContent = "";
  pill.className = "pill";
  pill.removeAttribute("title");
  const bar = $("progress-bar");
  bar.className = "";
  bar.style.width = "";
  bar.style.background = "";
  $("meta").textContent = "";
  window.__car.received = []; window.__car.shown = []; window.__car.resumedFrom = null;
  delete document.body.dataset.resumedFrom;
  for (const id of ["feed", "badges", "analysis", "reveal", "tool-stats", "outcome", "attribution", "fork-result", "tree", "diff"]) clear($(id));
  $("attribution").append(el("p", { class: "muted" }, "Counterfactual forward runs rank each step by how often re-deciding it rescues the heist."));
  $("hint").hidden = true;
  $("finished").hidden = true;
  $("lab").hidden = true;
  $("suspect-line").textContent = "No suspect marked yet.";
}

async function openSession(sid, opts) {
  opts = opts || {};
  resetView();
  const gen = S.gen;
  S.sid = sid;
  if (location.hash !== `#session=${sid}`) history.replaceState(null, "", `#session=${sid}`);
  $("empty").hidden = true;
  $("session").hidden = false;
  $("sid").textContent = sid;
  for (const b of document.querySelectorAll(".session-list button")) b.classList.toggle("current", b.dataset.session === sid);
  const r = await api("GET", `/api/sessions/${encodeURIComponent(sid)}`);
  if (S.gen !== gen) return;
  if (!r.ok) {
    toast(errorText(r, `cannot open session ${sid}`), true);
    $("session").hidden = true; $("empty").hidden = false;
    return;
  }
  applyDetail(r.data);
  let cached = null;
  if (opts.resume) {
    try { cached = JSON.parse(sessionStorage.getItem(storageKey(sid)) || "null"); } catch (e) { cached = null; }
  }
  if (cached && Array.isArray(cached.events)) {
    for (const e of cached.events) handle(e, false);
    S.lastSeq = cached.lastSeq;
    window.__car.resumedFrom = cached.lastSeq;
    document.body.dataset.resumedFrom = String(cached.lastSeq);
  }
  connect(sid);
}

function applyDetail(d) {
  // the server said what became of the run: its row says what the list says again
  if (S.unknownRuns.delete(S.sid)) refillSessionRow(S.sid);
  S.controllable = !!d.controllable;
  S.agents = d.agents || [];
  S.rounds = d.rounds || 0;
  S.branch = !!d.parent_run_id;
  S.scenario = d.scenario || null;
  setStatus(d.status);
  $("meta").textContent = `policy ${d.policy || "?"} · ${plural(S.agents.length, "agent")} · ${plural(d.rounds ?? "?", "round")}`
    + (d.parent_run_id ? ` · branch of ${d.parent_run_id} at step ${d.fork_step}` : "");
  renderBadges();
  if (d.outcome || !LIVE.has(d.status)) renderOutcome(d);
  if (d.verdict) renderVerdict(d.verdict);
}

// The live stream is read with fetch, not EventSource: an EventSource neither tells the HTTP
// status of a reconnect that failed nor tries again after one, so the page could say nothing
// and the dot stayed on. Here a refusal (403, 404, any other 4xx) stops the stream, a busy or
// failing server (429, 5xx) and a lost connection are tried again after Retry-After or a
// back-off (1, 2, 4 … 30 s), and the note under the card's title says which and why. Once
// stopped, the page no longer knows the run's state: it asks the server once (recheck).
const STREAM_WORDS = {
  0: "the server is not reachable", 403: "the server refused it", 404: "the server does not know this session",
  429: "the server is busy", 500: "the server failed", 502: "the server is not reachable",
  503: "the server is not available", 504: "the server did not answer in time",
};

function streamWords(status) {
  if (STREAM_WORDS[status]) return STREAM_WORDS[status];
  return status >= 500 ? "the server failed" : "the server refused it";
}

// seconds to wait as a Retry-After header says (seconds or an HTTP date), within 1..300
function retryAfter(value) {
  if (!value) return null;
  let secs = /^\s*\d+\s*$/.test(value) ? parseInt(value, 10) : (Date.parse(value) - Date.now()) / 1000;
  if (isNaN(secs)) return null;
  return Math.min(300, Math.max(1, Math.ceil(secs)));
}

function streamNote(text) {
  const note = $("stream-note");
  note.textContent = text || "";
  note.hidden = !text;
}

function syncLive() {
  $("live").hidden = S.status !== "recording" || !S.streamOk;
}

// Pause, Resume and Stop act on what the stream shows: they are offered only while it is
// connected
function setStreamOk(ok) {
  S.streamOk = ok;
  syncLive();
  syncButtons();
}

// the note of a live stream stopped for good (`why`: its reason) while the server still
// reports the run live: nothing the page shows of it moves any more, nor may it be controlled
function deadStreamNote(why) {
  streamNote(`Live view stopped: ${why}. The server still reports the run ${S.status}, but this page `
    + "no longer receives its events: its controls stay off. Reload the page to try again.");
}

function connect(sid) {
  const gen = S.gen;
  const ctl = new AbortController();
  const stream = { failures: 0, timer: null, close: () => { clearTimeout(stream.timer); ctl.abort(); } };
  S.stream = stream;
  const current = () => S.stream === stream && S.gen === gen;

  const down = (status, wait, words) => {
    setStreamOk(false);
    const why = `${words || streamWords(status)}${status ? ` (HTTP ${status})` : ""}`;
    if (wait === null) {
      S.stream = null;
      streamNote(`Live view stopped: ${why}. Reload the page to try again.`);
      recheck(sid, gen, why);
      return;
    }
    streamNote(`Live view interrupted: ${why}; retrying in ${wait} s.`);
    stream.timer = setTimeout(attempt, wait * 1000);
  };
  // a try that failed with `status` (0: no answer, or the stream broke off)
  const failed = (status, after, words) => {
    if (!current()) return;
    if (status && status !== 429 && status < 500) return down(status, null, words);
    stream.failures += 1;
    down(status, retryAfter(after) ?? Math.min(30, 2 ** (stream.failures - 1)), words);
  };

  async function attempt() {
    stream.timer = null;
    if (!current()) return;
    let res;
    try {
      res = await fetch(`/api/sessions/${encodeURIComponent(sid)}/events?after=${S.lastSeq}`, {
        headers: { Accept: "text/event-stream" }, cache: "no-store", signal: ctl.signal,
      });
    } catch (e) {
      failed(0, null);
      return;
    }
    if (!current()) { ctl.abort(); return; }
    if (res.status !== 200 || !res.body || !/^text\/event-stream/i.test(res.headers.get("Content-Type") || "")) {
      try { res.body && res.body.cancel(); } catch (e) { /* nothing to release */ }
      failed(res.status, res.headers.get("Retry-After"), res.status === 200 ? "the answer was no event stream" : null);
      return;
    }
    streamNote(null);
    setStreamOk(true);
    let ended = false;
    try {
      ended = await readEvents(res.body, () => current(), (type, data) => {
        stream.failures = 0;  // something came: the next break is a first one again
        if (type === "ping") return;
        if (type === "end") return;
        const e = JSON.parse(data);
        window.__car.received.push(e.seq);
        handle(e, true);
      });
    } catch (e) {
      ended = false;
    }
    if (!current()) return;
    if (!ended) { failed(0, null, "the connection was lost"); return; }
    S.stream = null;
    setStreamOk(false);
    window.__car.ends += 1;
    const r = await api("GET", `/api/sessions/${encodeURIComponent(sid)}`);
    if (r.ok && S.gen === gen) {
      applyDetail(r.data);
      showLab();
      if (LIVE.has(S.status)) deadStreamNote("the server ended the stream");
    }
    loadSessions(false);
  }
  attempt();
}

// the live stream stopped for good: the status shown and the controls offered may be stale, so
// the server is asked once for the session; when it answers, the page shows what it says, else
// the run's state is unknown and no control of it applies until a session is opened again (its
// row in the sessions list says so too, and the list is loaded again); a run the server still
// reports live keeps its controls off: its stream is dead
async function recheck(sid, gen, why) {
  const r = await api("GET", `/api/sessions/${encodeURIComponent(sid)}`);
  if (S.gen !== gen) return;
  if (r.ok) {
    applyDetail(r.data);
    showLab();
    if (LIVE.has(S.status)) deadStreamNote(why);
  } else {
    setUnknown();
  }
  loadSessions(false);
}

const UNKNOWN_TITLE = "The live view stopped and the server did not say what became of this run.";

function setUnknown() {
  Object.assign(S, { unknown: true, status: null, controllable: false, pending: null });
  S.unknownRuns.add(S.sid);
  refillSessionRow(S.sid);
  const pill = $("status");
  pill.hidden = false;
  pill.textContent = "unknown";
  pill.className = "pill unknown";
  pill.title = UNKNOWN_TITLE;
  $("progress-bar").style.background = "";
  $("progress-bar").className = "unknown";
  $("lab").hidden = true;
  syncLive();
  syncButtons();
}

// Server-Sent Events from a response body: onEvent(type, data) for each event ("ping" for a
// comment line, the server's keep-alive); true once an "end" event came, false when the body
// ended before (or `alive()` turned false: another session was opened)
async function readEvents(body, alive, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  const eol = /\r\n|\r|\n/g;
  let buf = "", type = "", data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done || !alive()) return false;
      buf += decoder.decode(value, { stream: true });
      let from = 0, m;
      eol.lastIndex = 0;
      while ((m = eol.exec(buf))) {
        if (m[0] === "\r" && eol.lastIndex === buf.length) break;  // maybe half of a \r\n
        const line = buf.slice(from, m.index);
        from = eol.lastIndex;
        if (line === "") {
          if (data.length) {
            const t = type || "message";
            onEvent(t, data.join("\n"));
            if (t === "end") return true;
            if (!alive()) return false;
          }
          type = ""; data = [];
        } else if (line[0] === ":") {
          onEvent("ping", null);
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let v = colon < 0 ? "" : line.slice(colon + 1);
          if (v[0] === " ") v = v.slice(1);
          if (field === "event") type = v;
          else if (field === "data") data.push(v);
        }
      }
      buf = buf.slice(from);
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// ------------------------------------------------------------------ events

function handle(e, live) {
  if (e.seq <= S.lastSeq || S.seen.has(e.seq)) return;
  S.seen.add(e.seq);
  S.lastSeq = e.seq;
  S.events.push(e);
  window.__car.shown.push(e.seq);
  switch (e.kind) {
    case "run_started":
      S.agents = e.agents; S.rounds = e.rounds; renderBadges(); setStatus("recording");
      break;
    case "tool_result": {
      S.tools.push(e);
      const s = S.stats[e.agent] || (S.stats[e.agent] = { calls: 0, ok: 0, failed: 0 });
      s.calls += 1;
      if (e.success) s.ok += 1; else s.failed += 1;
      addTool(e); S.statsQueued = true; renderSoon(); break;
    }
    case "message":
      addMessage(e); break;
    case "control":
      if (S.pending === e.action) S.pending = null;
      sysLine(e.seq, { pause: "⏸ paused", resume: "▶ resumed", stop: "⏹ stopped" }[e.action] || e.action);
      setStatus(e.action === "pause" ? "paused" : e.action === "resume" ? "recording" : S.status);
      break;
    case "run_ended":
      sysLine(e.seq, `heist ${e.status}` + (e.error ? `: ${e.error}` : ""));
      setStatus(e.status);
      break;
    case "verdict":
      renderVerdict(e); break;
  }
  if (e.step !== null && e.step !== undefined) updateProgress(e.step + 1);
  if (live) {
    saveSoon();
    S.scrollQueued = true;
    renderSoon();
  }
}

// the statistics and the feed's scroll position, once the events at hand are all handled
function renderSoon() {
  if (S.renderQueued) return;
  S.renderQueued = true;
  const gen = S.gen;
  queueMicrotask(() => {
    if (S.gen !== gen) return;
    S.renderQueued = false;
    if (S.statsQueued) {
      S.statsQueued = false;
      renderStats();
    }
    if (S.scrollQueued) {
      S.scrollQueued = false;
      const feed = $("feed");
      feed.scrollTop = feed.scrollHeight;
      window.__car.scrolled += 1;
    }
  });
}

function stepItem(e) {
  let li = S.stepsEl.get(e.step);
  if (li) return li;
  const text = el("p", { class: "text" });
  const tools = el("div", { class: "tools" });
  li = el("li", { dataset: { step: e.step, agent: e.agent } },
    avatar(e.agent),
    el("div", {}, el("span", { class: "who" }, nameText(e.agent)), el("span", { class: "step" }, `step ${e.step}`), text, tools));
  li._text = text; li._tools = tools;
  S.stepsEl.set(e.step, li);
  $("feed").append(li);
  return li;
}

function addMessage(e) {
  const li = stepItem(e);
  li._text.textContent = e.text;
  li.dataset.seq = e.seq;
  li.classList.add("msg");
}

function addTool(e) {
  const li = stepItem(e);
  const result = e.success ? (e.output || "") : (e.error || "failed");
  li._tools.append(el("div", { class: "tool " + (e.success ? "ok" : "fail") },
    el("span", { class: "mark" }, e.success ? "✓" : "✗"),
    el("code", {}, el("bdi", { class: "tool-name" }, e.tool), "(", el("bdi", {}, short(e.param, 80)), ")"),
    el("details", {}, el("summary", { class: "muted small" }, e.success ? "result" : "error"), el("pre", {}, result))));
}

function sysLine(seq, text) {
  $("feed").append(el("li", { class: "sys", dataset: { seq } }, text));
}

function updateProgress(steps) {
  const total = (S.rounds || 0) * (S.agents.length || 1);
  if (total) $("progress-bar").style.width = `${Math.min(100, (100 * steps) / total)}%`;
}

function setStatus(status) {
  if (!status) return;
  S.status = status;
  const pill = $("status");
  pill.hidden = false;
  pill.textContent = status;
  pill.className = `pill ${status}`;
  pill.removeAttribute("title");
  $("progress-bar").className = "";
  const live = LIVE.has(status);
  if (!live) S.pending = null;
  syncLive();
  syncButtons();
  if (!live) $("progress-bar").style.background = status === "completed" ? "var(--ok)" : "var(--bad)";
  else $("progress-bar").style.background = "";
}

// what each button may do now: a control already requested (double click) or one on its way
// is not sent twice, a branch or a run still live is not accused, nor one accused already;
// nothing applies to a run whose state is unknown (its status is null then)
function syncButtons() {
  const status = S.status, live = LIVE.has(status);
  const ctl = S.controllable && !S.busy && !S.unknown && S.streamOk;
  const stopping = S.pending === "stop";
  $("btn-pause").disabled = !(ctl && status === "recording" && !S.pending);
  $("btn-resume").disabled = !(ctl && status === "paused" && !S.pending);
  $("btn-stop").disabled = !(ctl && live && !stopping);
  // a live run's controls are off while its stream is not connected: say why on them
  const offline = live && S.controllable && !S.streamOk ? "The live view is not connected." : null;
  for (const id of ["btn-pause", "btn-resume", "btn-stop"]) {
    if (offline) $(id).title = offline; else $(id).removeAttribute("title");
  }
  // rules and llm read a live run's steps so far; causal and replay need it ended (the
  // server says so if asked)
  $("btn-analyze").disabled = !S.sid || !status || $("btn-analyze").textContent !== "Analyze behaviour";
  // replay re-decides each step with its recorded seed, as secret as the mole: offered once
  // the run is accused (the server refuses it before)
  const replay = $("method").querySelector("option[value=replay]");
  replay.disabled = !S.verdict;
  replay.title = S.verdict ? "" : "Replay reads the recorded step seeds, as secret as the mole: it runs once the run is accused.";
  if (replay.disabled && $("method").value === "replay") $("method").value = "rules";
  $("btn-reveal").disabled = !status || live || !!S.verdict || S.busy || S.branch || S.unknown
    || (S.scenario !== null && S.scenario !== "heist");
  $("btn-attribute").disabled = S.attributing || S.unknown;
  $("fork-form").querySelector("button[type=submit]").disabled = S.forking || S.unknown;
  if (S.branch && !S.verdict) $("suspect-line").textContent = "A branch is not accused: the accusation is its game's.";
  else if (S.scenario === "imported") $("suspect-line").textContent = "An imported trace is no game: it is not accused.";
}

// ------------------------------------------------------------------ crew and stats

// the badges are built once per crew and then updated in place: a badge rebuilt on every
// event would lose the keyboard focus and a click whose press and release straddle an event
function renderBadges() {
  const box = $("badges");
  const key = JSON.stringify(S.agents);
  if (S.badgeKey !== key) {
    clear(box);
    S.badgeKey = key;
    for (const a of S.agents) {
      const b = el("button", { type: "button", class: "badge", dataset: { agent: a }, onclick: () => toggleSuspect(a) },
        avatar(a), el("span", {}, nameText(a)), el("span", { class: "tools" }));
      b._tools = b.lastChild;
      box.append(b);
    }
  }
  let i = 0;
  for (const b of box.children) {
    const a = S.agents[i++];
    const st = S.stats[a];
    b.classList.toggle("suspect", S.suspect === a);
    b.classList.toggle("mole", !!(S.verdict && S.verdict.mole === a));
    b.setAttribute("aria-pressed", S.suspect === a ? "true" : "false");
    const text = st ? `${st.ok}/${plural(st.calls, "tool")} ok` : "no tools yet";
    if (b._tools.textContent !== text) b._tools.textContent = text;
  }
}

function toggleSuspect(a) {
  if (S.verdict) return;
  S.suspect = S.suspect === a ? null : a;
  $("suspect-line").textContent = S.suspect ? `Your suspect: ${nameText(S.suspect)}` : "No suspect marked yet (revealing now gives up: BUSTED).";
  renderBadges();
}

function renderStats() {
  window.__car.statsDrawn += 1;
  const st = S.stats;
  const body = $("tool-stats");
  clear(body);
  for (const a of S.agents) {
    const s = st[a] || { calls: 0, ok: 0, failed: 0 };
    body.append(el("tr", { dataset: { agent: a } },
      el("td", {}, el("span", { style: `color:${colorOf(a)};font-weight:650` }, nameText(a))),
      el("td", {}, s.calls), el("td", {}, s.ok), el("td", {}, s.failed),
      el("td", {}, s.calls ? fmtPct(s.ok / s.calls) : "–")));
  }
  renderBadges();
}

// ------------------------------------------------------------------ controls

// the error an answer names, else its status: never "undefined"
function errorText(r, fallback) {
  const d = r.data;
  let msg = d && typeof d === "object" && !Array.isArray(d) ? d.error ?? d.detail : null;
  if (msg !== null && msg !== undefined && typeof msg !== "string") {
    try { msg = JSON.stringify(msg); } catch (e) { msg = null; }
  }
  if (!msg) msg = fallback;
  return r.status ? `${msg} (HTTP ${r.status})` : msg;
}

async function control(action) {
  const gen = S.gen;
  // pending until the stream shows it (at the next step, maybe before this answer arrives)
  S.busy = true; S.pending = action; syncButtons();
  const r = await api("POST", `/api/sessions/${encodeURIComponent(S.sid)}/${action}`);
  if (S.gen !== gen) return;
  S.busy = false;
  if (!r.ok) {
    if (S.pending === action) S.pending = null;
    toast(errorText(r, `${action} failed`), true);
  } else toast(`${action} requested: it takes effect at the next step`);
  syncButtons();
}

async function quickStart() {
  const body = {};
  const rounds = parseInt($("qs-rounds").value, 10);
  if (!isNaN(rounds)) body.rounds = rounds;
  const seed = $("qs-seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  const delay = $("qs-delay").value.trim();
  if (delay !== "") body.step_delay = parseFloat(delay);
  $("quick-start").disabled = true;
  const r = await api("POST", "/api/sessions", body);
  $("quick-start").disabled = false;
  if (!r.ok) { toast(errorText(r, "could not start a heist"), true); return; }
  await loadSessions(false);
  openSession(r.data.session_id);
}

// ------------------------------------------------------------------ analysis

async function analyze() {
  const sid = S.sid, gen = S.gen;
  const btn = $("btn-analyze");
  btn.disabled = true;
  btn.textContent = "Analyzing…";
  const r = await api("POST", "/api/ai-detect/analyze", { session_id: sid, method: $("method").value });
  btn.textContent = "Analyze behaviour";
  syncButtons();
  if (S.gen !== gen) return;
  if (!r.ok) { toast(errorText(r, "analysis failed"), true); return; }
  renderAnalysis(r.data);
}

function renderAnalysis(a) {
  const box = $("analysis");
  clear(box);
  const scores = a.suspicion_scores || {};
  const agents = S.agents.length ? S.agents : Object.keys(scores);
  const max = Math.max(0.0001, ...agents.map((x) => scores[x] || 0));
  const bars = el("div", { class: "bars" });
  for (const ag of agents) {
    const v = scores[ag] || 0;
    bars.append(el("div", { class: "bar-row" + (ag === a.suggested_mole ? " top" : ""), dataset: { agent: ag } },
      el("span", {}, nameText(ag)),
      el("span", { class: "track" }, el("span", { class: "fill", style: `display:block;width:${(100 * v) / max}%` })),
      el("span", { class: "num" }, fmt3(v))));
  }
  box.append(bars);
  const sb = a.score_breakdown || {};
  const cols = SIGNALS.filter(([k]) => agents.some((ag) => sb[ag] && sb[ag][k] !== undefined && sb[ag][k] !== null));
  if (cols.length) {
    const table = el("table", { class: "breakdown" },
      el("thead", {}, el("tr", {}, el("th", {}, "agent"), cols.map(([, label]) => el("th", {}, label)))));
    const tb = el("tbody");
    for (const ag of agents) {
      const row = sb[ag] || {};
      const best = Math.max(...cols.map(([k]) => row[k] || 0));
      tb.append(el("tr", {}, el("td", {}, nameText(ag)),
        cols.map(([k]) => el("td", { class: row[k] === best && best > 0 ? "hot" : null }, fmt3(row[k])))));
    }
    table.append(tb);
    box.append(table);
  }
  const hint = $("hint");
  // the blog's rule: a hint only when the detector is more than 60% sure
  if (typeof a.confidence === "number" && a.confidence > 0.6 && a.suggested_mole) {
    hint.textContent = `The AI is ${Math.round(a.confidence * 100)}% confident that ${nameText(a.suggested_mole)} is the mole.`;
    hint.hidden = false;
  } else {
    hint.hidden = true;
  }
  const notes = [`suggested ${a.suggested_mole ? nameText(a.suggested_mole) : "nobody"} · confidence ${fmtPct(a.confidence)}`];
  if (Array.isArray(a.methods_run)) notes.push(`methods: ${a.methods_run.join(", ")}`);
  box.append(el("p", { class: "note", id: "analysis-summary" }, notes.join(" · ")));
  for (const w of a.warnings || []) box.append(el("p", { class: "note" }, `⚠ ${w}`));
}

// ------------------------------------------------------------------ reveal

async function reveal() {
  if (S.busy || S.verdict || S.unknown) return;
  const gen = S.gen;
  S.busy = true; syncButtons();
  const r = await api("POST", `/api/sessions/${encodeURIComponent(S.sid)}/accuse`, { suspect: S.suspect });
  if (S.gen !== gen) return;
  S.busy = false; syncButtons();
  if (!r.ok) { toast(errorText(r, "accusation failed"), true); return; }
  renderVerdict(r.data);
}

function renderVerdict(v) {
  S.verdict = v;
  const box = $("reveal");
  clear(box);
  const says = { SUCCESS: "You caught the mole!", FAILURE: "Wrong agent: the mole got away.", BUSTED: "Nobody named: the crew is busted." };
  box.append(el("div", { class: `verdict ${v.verdict}`, id: "verdict" },
    el("div", { class: "big" }, v.verdict),
    el("p", {}, says[v.verdict] || ""),
    el("p", {}, "The mole was ", el("strong", { id: "mole-name" }, nameText(v.mole)), "."),
    el("p", {}, "Strategy: ", el("strong", { id: "mole-strategy" }, v.strategy)),
    v.suspect ? el("p", { class: "muted small" }, `your suspect: ${nameText(v.suspect)}`) : null));
  $("suspect-line").textContent = v.suspect ? `You accused ${nameText(v.suspect)}.` : "You named nobody.";
  $("btn-reveal").disabled = true;
  renderBadges();
}

// ------------------------------------------------------------------ finished runs

function renderOutcome(d) {
  const box = $("outcome");
  clear(box);
  $("finished").hidden = false;
  const o = d.outcome;
  if (!o) {
    const unscored = d.scenario === "heist" ? " before the plan was scored." : ".";
    box.append(el("p", { class: "muted" }, d.error ? `The run ${d.status}: ${d.error}` : `The run ${d.status}${unscored}`));
    return;
  }
  box.append(el("div", { class: "outcome-line" },
    el("span", { class: `pill ${o.bad ? "bad" : "ok"}` }, o.bad ? "the plan would fail" : "the plan works"),
    el("span", { class: "muted" }, `score ${fmt3(o.score)}`)));
  if (Array.isArray(o.reasons) && o.reasons.length) {
    box.append(el("ul", { class: "reasons" }, o.reasons.map((r) => el("li", {}, r))));
  }
}

function showLab() {
  if (!S.status || LIVE.has(S.status) || S.scenario === "imported") return;
  $("lab").hidden = false;
  $("fork-at").max = Math.max(0, S.stepsEl.size - 1);
  loadTree();
}

async function loadTree() {
  const gen = S.gen;
  const r = await api("GET", `/api/sessions/${encodeURIComponent(S.sid)}/tree`);
  if (S.gen !== gen) return;
  const box = $("tree");
  clear(box);
  if (!r.ok) { box.append(el("p", { class: "muted" }, errorText(r, "no tree"))); return; }
  const render = (node, depth) => {
    const label = node.fork_step === null || node.fork_step === undefined ? "root" : `do_${node.op}@${node.fork_step}`;
    const verdict = node.verdict ? el("span", { class: `pill ${node.verdict}` }, node.verdict) : el("span", { class: `pill ${node.status}` }, node.status);
    const btn = el("button", { type: "button", class: node.session_id === S.sid ? "current" : null, dataset: { session: node.session_id },
      onclick: () => (node.fork_step === null || node.fork_step === undefined ? openSession(node.session_id) : showDiff(node.session_id)) },
      el("code", {}, node.session_id), el("span", { class: "muted" }, label), verdict);
    const li = el("li", {}, btn);
    const kids = node.children || [];
    const shown = kids.slice(0, 12);
    if (shown.length) li.append(el("ul", {}, shown.map((c) => render(c, depth + 1))));
    if (kids.length > shown.length) li.append(el("div", { class: "more" }, `… and ${plural(kids.length - shown.length, "more branch", "more branches")}`));
    return li;
  };
  box.append(el("ul", {}, render(r.data, 0)));
  const n = r.data.descendants || 0;
  box.append(el("p", { class: "note" }, n ? `${plural(n, "branch", "branches")} in this family; click one to diff it against its parent.` : "No branches yet: fork one above."));
}

async function showDiff(branch) {
  const gen = S.gen;
  const r = await api("GET", `/api/sessions/${encodeURIComponent(branch)}/diff`);
  if (S.gen !== gen) return;
  const box = $("diff");
  clear(box);
  if (!r.ok) { toast(errorText(r, "diff failed"), true); return; }
  const d = r.data;
  box.append(el("p", {}, el("strong", {}, `Branch ${d.session_id}`), ` vs parent ${d.parent_id}: forked at step ${d.fork_step}, `,
    d.first_diverging_step === null ? "no message differs." : `first diverging step ${d.first_diverging_step} (${plural(d.differing_steps, "step differs", "steps differ")}).`,
    " ", el("button", { type: "button", class: "btn small", onclick: () => openSession(d.session_id) }, "open branch")));
  for (const s of d.steps.slice(0, 8)) {
    const p = el("div", { class: "step" }, el("div", { class: "muted small" }, `step ${s.step} · ${nameText(s.agent)}`));
    const line = el("div");
    for (const seg of s.diff) {
      const tag = seg.op === "delete" ? "del" : seg.op === "insert" ? "ins" : "span";
      line.append(el(tag, {}, seg.text), " ");
    }
    p.append(line);
    box.append(p);
  }
}

// `extra`: more of the request (the settle button's `settle` and `seed`); a click passes
// its event, which asks for nothing more
async function attribute(extra) {
  const btn = $("btn-attribute");
  if (S.attributing || S.unknown) return;
  S.attributing = true; syncButtons();
  btn.textContent = "Running forward runs…";
  const sid = S.sid, gen = S.gen;
  const more = extra instanceof Event ? {} : extra || {};
  const r = await api("POST", `/api/sessions/${encodeURIComponent(sid)}/attribution`, { method: "contrastive", ...more });
  S.attributing = false; syncButtons();
  btn.textContent = "Attribute failure";
  if (S.gen !== gen) return;
  if (!r.ok) { toast(errorText(r, "attribution failed"), true); return; }
  renderAttribution(r.data);
  loadTree();
}

// The attribution chart and its notes, from the API's answer (also called by the tests).
function renderAttribution(d) {
  const box = $("attribution");
  clear(box);
  const rows = [...d.ranked].sort((a, b) => a.step - b.step);
  const max = Math.max(0.001, ...rows.map((x) => Math.max(Math.abs(x.ci[0]), Math.abs(x.ci[1]), Math.abs(x.effect))));
  const chart = el("div", { class: "chart" });
  for (const x of rows) {
    const ciLo = Math.min(Math.abs(x.ci[0]), Math.abs(x.ci[1])), ciHi = Math.max(Math.abs(x.ci[0]), Math.abs(x.ci[1]));
    chart.append(el("div", { class: "attr-row" + (x.step === d.locus ? " locus" : ""), dataset: { step: x.step }, title: x.message || "" },
      el("span", {}, `step ${x.step}`), el("span", { style: `color:${colorOf(x.agent)}` }, nameText(x.agent || "")),
      el("span", { class: "track" },
        el("span", { class: "fill", style: `width:${(100 * Math.abs(x.effect)) / max}%` }),
        el("span", { class: "ci", style: `left:${(100 * ciLo) / max}%;width:${Math.max(0.5, (100 * (ciHi - ciLo)) / max)}%` })),
      el("span", { class: "num" }, `${x.effect >= 0 ? "+" : ""}${fmt3(x.effect)} (n ${x.n})`)));
  }
  box.append(chart);
  box.append(el("p", { class: "note" }, d.locus === null || d.locus === undefined
    ? `No step's interval excludes zero. ${plural(d.forward_runs, "forward run")}.`
    : `Causal locus (point of commitment): step ${d.locus} (${nameText(d.locus_agent)}). ${plural(d.forward_runs, "forward run")}. Bars: |effect| with its 95% interval.`));
  if (d.locus_settled === false) box.append(el("p", { class: "note unsettled" }, unsettledText(d)));
  // what `car attribute --settle 3` does: scans until the later steps settle the locus
  if (d.locus_settled === false && d.to_settle && !d.settle) {
    box.append(el("button", { type: "button", class: "btn small", id: "btn-settle",
      title: "Up to 3 scans, each at a third of the 5% error rate, a later one with forward runs of its own at the width the one before suggested",
      onclick: () => attribute({ settle: 3, seed: d.seed ?? 0 }) }, "Settle it (up to 3 scans)"));
  }
  if (d.settle) box.append(el("p", { class: "note", id: "settle-line" }, settleText(d.settle)));
}

// What settling did: the scans made, the level of each, and how the last one ended.
function settleText(st) {
  const scans = st.scans || [];
  const last = scans[scans.length - 1] || {};
  const how = last.settled ? "Settled" : last.locus === null || last.locus === undefined ? "No locus" : "Not settled";
  const runs = scans.reduce((n, x) => n + x.forward_runs, 0);
  return `${how} after ${plural(scans.length, "scan")} of at most ${st.rounds} (each at ${+(100 * st.confidence_each).toPrecision(4)}%, ${100 * st.confidence}% in all; ${plural(runs, "forward run")}).`;
}

// Why a locus is not settled: later steps rescued no run, but their intervals still admit an
// effect as strong as the locus's; and what attribution request would settle it.
function unsettledText(d) {
  const later = d.not_excluded || [];
  const locus = d.ranked.find((x) => x.step === d.locus);
  const strength = locus ? ` (${fmt3(locus.effect)})` : "";
  let text = `Not settled: ${later.length === 1 ? "step" : "steps"} ${later.join(", ")} rescued no run, but could hold an effect as strong as step ${d.locus}'s${strength}.`;
  const fix = d.to_settle;
  if (fix && fix.half_width !== undefined) text += ` A half-width of ${fix.half_width} would settle it (~${fix.runs_per_step} forward runs a step).`;
  else if (fix && fix.runs !== undefined) text += ` ${fix.runs} runs a step would settle it.`;
  return text;
}

async function fork(ev) {
  ev.preventDefault();
  const body = { at: parseInt($("fork-at").value, 10), do: $("fork-do").value, n: parseInt($("fork-n").value, 10) };
  const v = $("fork-value").value;
  if (v.trim() !== "") body.value = v;
  const box = $("fork-result");
  if (S.forking || S.unknown) return;
  clear(box);
  box.append(el("p", { class: "muted" }, `Running ${plural(body.n, "branch", "branches")}…`));
  const gen = S.gen;
  S.forking = true; syncButtons();  // a double click would run every branch twice
  const r = await api("POST", `/api/sessions/${encodeURIComponent(S.sid)}/fork`, body);
  S.forking = false; syncButtons();
  if (S.gen !== gen) return;
  clear(box);
  if (!r.ok) { toast(errorText(r, "fork failed"), true); return; }
  const d = r.data;
  const rate = el("div", { class: "rate", id: "fork-rate" },
    el("strong", {}, `do_${d.op}(${d.at})`), `: bad rate ${fmt3(d.bad_rate)} (${d.bad}/${plural(d.scored, "branch", "branches")}), 95% CI [${fmt3(d.ci && d.ci[0])}, ${fmt3(d.ci && d.ci[1])}]`,
    ` · factual outcome ${d.factual_bad ? "bad" : "ok"}`);
  const bad = d.scored ? (100 * d.bad) / d.scored : 0;
  rate.append(el("div", { class: "dist", title: "bad / ok branches" },
    el("span", { class: "b", style: `width:${bad}%` }), el("span", { class: "g", style: `width:${100 - bad}%` })));
  box.append(rate);
  loadTree();
}

// ------------------------------------------------------------------ wiring

$("quick-start").addEventListener("click", quickStart);
$("btn-pause").addEventListener("click", () => control("pause"));
$("btn-resume").addEventListener("click", () => control("resume"));
$("btn-stop").addEventListener("click", () => control("stop"));
$("btn-analyze").addEventListener("click", analyze);
$("btn-reveal").addEventListener("click", reveal);
$("btn-attribute").addEventListener("click", attribute);
$("fork-form").addEventListener("submit", fork);
$("refresh-sessions").addEventListener("click", () => loadSessions(false));
$("more-sessions").addEventListener("click", () => loadSessions(true));
window.addEventListener("pagehide", saveNow);
window.addEventListener("hashchange", () => {
  const m = location.hash.match(/^#session=([\w-]+)$/);
  if (m && m[1] !== S.sid) openSession(m[1]);
});

(function boot() {
  loadSessions(false);
  const m = location.hash.match(/^#session=([\w-]+)$/);
  if (m) openSession(m[1], { resume: true });
  setInterval(() => { if (!document.hidden) loadSessions(false); }, 15000);
})();
