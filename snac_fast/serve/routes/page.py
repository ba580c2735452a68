"""``GET /``: a page to try the server: type text, pick a voice and a format, hear it as it streams,
with the time to first audio and the gaps between chunks shown as they happen.

``pcm`` plays through the Web Audio API (each chunk's samples scheduled right after the last);
``mp3`` and ``aac`` through Media Source Extensions; ``wav``, ``flac`` and ``opus`` once the whole
file has come (browsers' Media Source takes none of them as they are sent). The key, if the server
has one, is asked on the page and kept in the tab's session storage (gone with the tab). The page
is served with a Content-Security-Policy that allows its own inline script and style (by their
SHA-256) and requests to this server alone, and may not be framed.
"""

from __future__ import annotations

import base64
import hashlib
import re

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>snac-fast</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
  textarea { width: 100%; min-height: 8rem; font: inherit; box-sizing: border-box; }
  .row { display: flex; gap: .8rem; flex-wrap: wrap; align-items: center; margin: .6rem 0; }
  button { font: inherit; padding: .35rem 1.1rem; }
  table { border-collapse: collapse; margin-top: .8rem; }
  td { padding: .15rem .9rem .15rem 0; } td:first-child { color: #666; }
  #error { color: #b00; white-space: pre-wrap; }
  canvas { width: 100%; height: 60px; background: #f4f4f4; margin-top: .6rem; }
</style>
</head>
<body>
<h1>snac-fast</h1>
<textarea id="text">Hello there. This is snac-fast, speaking as the words arrive.</textarea>
<div class="row">
  <label>voice <select id="voice"></select></label>
  <label>format <select id="format">
    <option value="pcm">pcm (streamed)</option><option value="mp3">mp3 (streamed)</option>
    <option value="aac">aac (streamed)</option><option value="wav">wav</option>
    <option value="flac">flac</option><option value="opus">opus</option></select></label>
  <label>key <input id="key" type="password" size="14" placeholder="if the server has one"></label>
  <button id="speak">Speak</button>
</div>
<table>
  <tr><td>status</td><td id="status">idle</td></tr>
  <tr><td>time to first audio</td><td id="ttfa">–</td></tr>
  <tr><td>chunks</td><td id="chunks">0</td></tr>
  <tr><td>chunk gap p50 / max</td><td id="gaps">–</td></tr>
  <tr><td>audio received</td><td id="received">0 s</td></tr>
  <tr><td>audio played</td><td id="played">0 s</td></tr>
</table>
<canvas id="gapsplot" width="700" height="60"></canvas>
<div id="error"></div>
<script>
const $ = id => document.getElementById(id);
const RATE = 24000;
let audioContext = null;
$("key").value = sessionStorage.getItem("snac-fast-key") || "";

function headers() {
  const key = $("key").value.trim();
  sessionStorage.setItem("snac-fast-key", key);
  return key ? {"Authorization": "Bearer " + key} : {};
}

async function loadVoices() {
  try {
    const r = await fetch("/v1/audio/voices", {headers: headers()});
    const body = await r.json(), chosen = $("voice").value;
    $("voice").innerHTML = "";
    for (const v of body.voices || []) $("voice").add(new Option(v, v, false, v === chosen));
  } catch (e) { $("error").textContent = "voices: " + e; }
}

function drawGaps(gaps) {
  const c = $("gapsplot"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const top = Math.max(200, ...gaps), w = c.width / Math.max(gaps.length, 1);
  gaps.forEach((ms, i) => {
    g.fillStyle = ms > 2048 / RATE * 1000 * 1.5 ? "#c33" : "#48a";
    g.fillRect(i * w, c.height * (1 - ms / top), Math.max(w - 1, 1), c.height * ms / top);
  });
}

function median(values) {
  const s = [...values].sort((a, b) => a - b);
  return s.length ? s[Math.floor(s.length / 2)] : NaN;
}

function pcmPlayer() {  // int16 chunks scheduled one after another through Web Audio
  audioContext = audioContext || new AudioContext({sampleRate: RATE});
  audioContext.resume();
  let next = 0, rest = new Uint8Array(0), started = null, seconds = 0;
  return {
    push(bytes) {
      const all = new Uint8Array(rest.length + bytes.length);
      all.set(rest); all.set(bytes, rest.length);
      const whole = all.length - all.length % 2;
      rest = all.slice(whole);
      if (!whole) return;
      const ints = new Int16Array(all.buffer.slice(0, whole));
      const buffer = audioContext.createBuffer(1, ints.length, RATE);
      const out = buffer.getChannelData(0);
      for (let i = 0; i < ints.length; i++) out[i] = ints[i] / 32768;
      const source = audioContext.createBufferSource();
      source.buffer = buffer; source.connect(audioContext.destination);
      next = Math.max(next, audioContext.currentTime + 0.05);
      if (started === null) started = next;
      source.start(next);
      next += buffer.duration; seconds += buffer.duration;
    },
    received() { return seconds; },
    played() { return started === null ? 0 : Math.min(seconds, Math.max(0, audioContext.currentTime - started)); },
    done() {},
  };
}

function mediaPlayer(type) {  // mp3 / aac through Media Source Extensions, or a whole file
  const audio = new Audio(), queue = [];
  let sourceBuffer = null, ended = false, whole = [];
  if (type && window.MediaSource && MediaSource.isTypeSupported(type)) {
    const media = new MediaSource();
    audio.src = URL.createObjectURL(media);
    media.addEventListener("sourceopen", () => {
      sourceBuffer = media.addSourceBuffer(type);
      sourceBuffer.addEventListener("updateend", () => {
        if (queue.length) sourceBuffer.appendBuffer(queue.shift());
        else if (ended && media.readyState === "open") media.endOfStream();
      });
      if (queue.length) sourceBuffer.appendBuffer(queue.shift());
    });
    audio.play().catch(() => {});
    return {
      push(bytes) {
        if (sourceBuffer && !sourceBuffer.updating && !queue.length) sourceBuffer.appendBuffer(bytes);
        else queue.push(bytes);
      },
      received() { return sourceBuffer && sourceBuffer.buffered.length ? sourceBuffer.buffered.end(0) : 0; },
      played() { return audio.currentTime; },
      done() { ended = true; if (sourceBuffer && !sourceBuffer.updating && !queue.length && media.readyState === "open") media.endOfStream(); },
    };
  }
  return {
    push(bytes) { whole.push(bytes); },
    received() { return audio.duration || 0; },
    played() { return audio.currentTime; },
    done(mime) { audio.src = URL.createObjectURL(new Blob(whole, {type: mime})); audio.play().catch(() => {}); },
  };
}

async function speak() {
  $("error").textContent = "";
  $("speak").disabled = true;
  const format = $("format").value;
  const player = format === "pcm" ? pcmPlayer() : mediaPlayer({mp3: "audio/mpeg", aac: "audio/aac"}[format]);
  const arrivals = [];
  let chunks = 0, timer = null;
  const sent = performance.now();
  const show = () => {
    const gaps = arrivals.slice(1).map((t, i) => t - arrivals[i]);
    $("chunks").textContent = chunks;
    $("gaps").textContent = gaps.length ? median(gaps).toFixed(0) + " / " + Math.max(...gaps).toFixed(0) + " ms" : "–";
    $("received").textContent = player.received().toFixed(2) + " s";
    $("played").textContent = player.played().toFixed(2) + " s";
    drawGaps(gaps);
  };
  try {
    $("status").textContent = "asking";
    const r = await fetch("/v1/audio/speech", {method: "POST", headers: {"Content-Type": "application/json", ...headers()},
      body: JSON.stringify({input: $("text").value, voice: $("voice").value, response_format: format})});
    if (!r.ok) throw new Error(r.status + " " + ((await r.json().catch(() => ({}))).error || {}).message);
    timer = setInterval(show, 100);
    $("status").textContent = "streaming";
    const reader = r.body.getReader();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      const now = performance.now();
      if (!arrivals.length) $("ttfa").textContent = (now - sent).toFixed(0) + " ms";
      arrivals.push(now); chunks++;
      player.push(value);
    }
    player.done(r.headers.get("Content-Type"));
    $("status").textContent = "done";
  } catch (e) {
    $("status").textContent = "failed";
    $("error").textContent = String(e);
  } finally {
    show();
    $("speak").disabled = false;
    setTimeout(() => { show(); clearInterval(timer); }, 30000);
  }
}

$("speak").addEventListener("click", speak);
$("key").addEventListener("change", loadVoices);
loadVoices();
</script>
</body>
</html>
"""


def _inline_hash(tag: str) -> str:
    body = re.search(rf"<{tag}>(.*?)</{tag}>", PAGE, re.S)[1]
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


# the page's own inline script and style, requests to this server, audio from blob: URLs (Media
# Source); nothing else loads, and no other site may frame it
SECURITY_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_inline_hash('script')}; "
                               f"style-src {_inline_hash('style')}; connect-src 'self'; media-src 'self' blob:; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


async def page(request):
    """The route."""
    from starlette.responses import HTMLResponse

    return HTMLResponse(PAGE, headers=SECURITY_HEADERS)
