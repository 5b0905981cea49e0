// The little behaviour htmx does not cover: theme, keyboard, copy buttons, scrolling.
// Loaded in <head> without defer so the saved theme applies before the first paint.
"use strict";

(function () {
  const root = document.documentElement;
  const saved = localStorage.getItem("mlxchat-theme");
  if (saved) root.dataset.theme = saved;

  function toggleTheme() {
    const dark = root.dataset.theme
      ? root.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    root.dataset.theme = dark ? "light" : "dark";
    localStorage.setItem("mlxchat-theme", root.dataset.theme);
  }

  function copy(text, button) {
    navigator.clipboard.writeText(text).then(() => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
  }

  function nearBottom(el) {
    return el.scrollHeight - el.scrollTop - el.clientHeight < 120;
  }

  document.addEventListener("click", (e) => {
    const t = e.target;
    if (!(t instanceof Element)) return;
    // On a narrow screen the open sidebar covers its toggle: a tap beside it closes it.
    if (sidebarOpen() && !t.closest("#sidebar, #sidebar-toggle")) setSidebar(false);
    if (t.closest("#theme-toggle")) toggleTheme();
    else if (t.closest("#sidebar-toggle")) setSidebar(!sidebarOpen());
    else if (t.matches(".code > .copy")) copy(t.parentElement.querySelector("code").innerText, t);
    else if (t.matches(".copy-message")) copy(t.closest(".message").querySelector(".body").innerText, t);
    else if (t.matches(".remove-chip")) t.closest(".chip").remove();
  });

  document.addEventListener("keydown", (e) => {
    const t = e.target;
    // Enter sends, Shift+Enter is a new line (in the composer and the edit form).
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && t instanceof HTMLTextAreaElement && t.form && t.form.hasAttribute("ws-send")) {
      e.preventDefault();
      if (t.value.trim()) t.form.requestSubmit();
    } else if (e.key === "Escape" && sidebarOpen()) {
      setSidebar(false);
    } else if (e.key === "Escape") {
      const stop = document.getElementById("stop");
      if (stop) { e.preventDefault(); stop.click(); }
    } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === "o") {
      e.preventDefault();
      document.getElementById("new-chat").click();
    } else if ((e.ctrlKey || e.metaKey) && e.key.toLowerCase() === "k") {
      e.preventDefault();
      document.getElementById("search").focus();
    }
  });

  // A message larger than the socket's frame limit (data-ws-max) is not sent: the server would
  // close the socket under it. The composer keeps it and a notice says what to do instead.
  function notice(text) {
    const box = document.getElementById("notice");
    if (!box) return;
    const p = document.createElement("p");
    p.className = "notice-text";
    p.textContent = text;
    box.replaceChildren(p);
  }
  document.addEventListener("htmx:wsConfigSend", (e) => {
    const limit = Number(document.getElementById("chat")?.dataset.wsMax || 0);
    const frame = JSON.stringify({ ...e.detail.parameters, HEADERS: e.detail.headers });
    const size = new TextEncoder().encode(frame).length;
    if (limit && size > limit) {
      e.preventDefault();
      notice(`This message is too large to send (${(size / 1048576).toFixed(1)} MB; the limit is ` +
             `${(limit / 1048576).toFixed(1)} MB). Attach long text as a file instead.`);
    }
  });
  // A socket the server closed for a reason the ws extension does not retry (e.g. 1009, a frame
  // too large) is opened again by reloading the page, after a notice; a page being left is not.
  let leaving = false;
  window.addEventListener("beforeunload", () => { leaving = true; });
  document.addEventListener("htmx:wsClose", (e) => {
    const code = e.detail.event && e.detail.event.code;
    // 1005: closed by the page itself (its chat was swapped out); 1006/1011-1013: retried by htmx.
    if (leaving || !e.target.isConnected || [1000, 1001, 1005, 1006, 1011, 1012, 1013].includes(code)) return;
    notice(`The connection closed (code ${code}); reconnecting…`);
    setTimeout(() => location.reload(), 1500);
  });

  // Clear the composer (text and attachment chips) once its message is on its way.
  document.addEventListener("htmx:wsAfterSend", (e) => {
    if (e.target.id !== "composer") return;
    document.getElementById("prompt").defaultValue = "";
    e.target.reset();
    document.getElementById("attachments").replaceChildren();
  });

  // Each attached file is uploaded on its own (POST <form data-upload>?name=..., the file as the
  // body), its chip showing the upload's progress; the server's chip (app/ui/uploads.py) then takes its
  // place and polls while the file is read.
  function uploadChip(file) {
    const chip = document.createElement("span");
    chip.className = "chip upload sending";
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = file.name;
    const bar = document.createElement("progress");
    bar.max = 1; bar.value = 0; bar.setAttribute("aria-label", `Uploading ${file.name}`);
    chip.append(name, " · ", bar);
    return chip;
  }
  function refused(chip, text) {
    chip.className = "chip upload refused";
    chip.setAttribute("role", "alert");
    chip.replaceChildren(chip.querySelector(".name"), `: ${text} `);
    const dismiss = document.createElement("button");
    dismiss.type = "button"; dismiss.className = "subtle remove-chip"; dismiss.textContent = "×";
    dismiss.setAttribute("aria-label", "Dismiss");
    chip.append(dismiss);
  }
  function upload(file) {
    const form = document.getElementById("attach-form");
    const box = document.getElementById("attachments");
    if (!form || !box) return;
    const chip = uploadChip(file);
    box.append(chip);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `${form.dataset.upload}?name=${encodeURIComponent(file.name)}`);
    xhr.setRequestHeader("HX-Request", "true");
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) chip.querySelector("progress").value = e.loaded / e.total; };
    xhr.onload = () => {
      if (xhr.status === 201) {
        const t = document.createElement("template");
        t.innerHTML = xhr.responseText.trim();
        const fresh = t.content.firstElementChild;
        chip.replaceWith(fresh);
        htmx.process(fresh);
      } else {
        let text = `upload failed (${xhr.status})`;
        try { text = JSON.parse(xhr.responseText).error.message; } catch (_) { /* not JSON */ }
        refused(chip, text);
      }
    };
    xhr.onerror = () => refused(chip, "the upload did not reach the server");
    xhr.send(file);
  }
  function attach(files) {
    if (!files || !files.length) return false;
    for (const f of files) upload(f);
    return true;
  }
  document.addEventListener("change", (e) => {
    if (e.target.id !== "attach-file") return;
    attach(e.target.files);
    e.target.value = "";
  });
  const inComposer = (e) => e.target instanceof Element && e.target.closest(".composer");
  document.addEventListener("dragover", (e) => { if (inComposer(e)) e.preventDefault(); });
  document.addEventListener("drop", (e) => { if (inComposer(e) && attach(e.dataTransfer.files)) e.preventDefault(); });
  document.addEventListener("paste", (e) => { if (inComposer(e) && attach(e.clipboardData.files)) e.preventDefault(); });
  // An upload the server refused outright (413: over its body limit) says so where chips or the
  // import result would have gone.
  document.addEventListener("htmx:responseError", (e) => {
    const target = e.detail.target;
    if (!target || !["attachments", "import-result"].includes(target.id)) return;
    const p = document.createElement("p");
    p.className = "field-error";
    p.textContent = e.detail.xhr.status === 413 ? "That upload is too large." : `Upload failed (${e.detail.xhr.status}).`;
    target.append(p);
  });

  // Follow a streaming answer unless the user scrolled up to read.
  let follow = true;
  document.addEventListener("htmx:wsBeforeMessage", () => {
    const list = document.getElementById("messages");
    follow = list ? nearBottom(list) : false;
  });
  document.addEventListener("htmx:wsAfterMessage", () => {
    const list = document.getElementById("messages");
    if (list && follow) list.scrollTop = list.scrollHeight;
  });
  function sidebarOpen() {
    return document.body.classList.contains("sidebar-open");
  }
  function setSidebar(open) {
    document.body.classList.toggle("sidebar-open", open);
    document.getElementById("sidebar-toggle")?.setAttribute("aria-expanded", String(open));
  }
  // A conversation just opened (page load or boosted navigation): show its end, ready to type.
  function opened() {
    setSidebar(false);
    const list = document.getElementById("messages");
    if (list) list.scrollTop = list.scrollHeight;
    const prompt = document.getElementById("prompt");
    if (prompt) prompt.focus();
  }
  // The tab's title follows the chat's (renamed, or named by its first message).
  function syncTitle() {
    const heading = document.getElementById("chat-title");
    if (heading) document.title = `${heading.textContent.trim()} · mlxchat`;
  }
  document.addEventListener("htmx:afterSettle", syncTitle);
  document.addEventListener("htmx:wsAfterMessage", syncTitle);
  document.addEventListener("DOMContentLoaded", opened);
  document.addEventListener("htmx:afterSwap", (e) => { if (e.target === document.body) opened(); });
  // --- Voice (app/ui/voice.py): the microphone fills the composer with a transcript to edit and
  // send; "Listen" reads an answer aloud, streamed. The page asks for the microphone only when
  // the button is pressed, and says which model to pull when none is installed.
  let voice = null;  // GET /voice: the installed speech models, or the `mlxchat pull` line
  const voiceStatus = () => voice || (voice = fetch("/voice").then((r) => r.json()).catch(() => ({})));
  async function missing(kind) {
    const pull = ((await voiceStatus())[kind] || {}).pull;
    if (pull) notice(`No ${kind === "speech" ? "text-to-speech" : "speech-to-text"} model is installed: run \`${pull}\`, then reload the page.`);
    return Boolean(pull);
  }
  async function errorText(response) {
    try { return (await response.json()).error.message; } catch (_) { return `failed (${response.status})`; }
  }
  let recorder = null;
  function setMic(state) {
    const button = document.getElementById("mic");
    if (!button) return;
    button.dataset.state = state;
    button.setAttribute("aria-pressed", String(state === "recording"));
    button.textContent = { recording: "Stop", transcribing: "Transcribing…" }[state] || "Speak";
    button.disabled = state === "transcribing";
  }
  async function transcribe(blob) {
    setMic("transcribing");
    const form = new FormData();
    form.append("file", blob, blob.type.includes("ogg") ? "speech.ogg" : "speech.webm");
    form.append("model", "whisper-1");
    try {
      const response = await fetch("/v1/audio/transcriptions", { method: "POST", body: form });
      if (!response.ok) { notice(`Transcription: ${await errorText(response)}`); return; }
      const text = (await response.json()).text.trim();
      const prompt = document.getElementById("prompt");
      if (prompt && text) prompt.value = prompt.value.trim() ? `${prompt.value.trimEnd()} ${text}` : text;
      if (prompt) prompt.focus();
    } catch (_) {
      notice("The recording did not reach the server.");
    } finally {
      setMic("idle");
    }
  }
  async function toggleMic() {
    if (recorder) { recorder.stop(); return; }
    if (await missing("transcription")) return;
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (err) {
      notice(`The microphone is not available (${err.message || err.name}).`);
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (e) => { if (e.data.size) chunks.push(e.data); });
    recorder.addEventListener("stop", () => {
      stream.getTracks().forEach((t) => t.stop());
      const type = recorder.mimeType;
      recorder = null;
      transcribe(new Blob(chunks, { type }));
    });
    recorder.start();
    setMic("recording");
  }
  const player = new Audio();
  let speaking = null;  // the "Listen" button of the answer being read
  function stopSpeaking() {
    player.pause();
    player.removeAttribute("src");
    if (speaking) { speaking.textContent = "Listen"; speaking.setAttribute("aria-pressed", "false"); }
    speaking = null;
  }
  player.addEventListener("ended", stopSpeaking);
  player.addEventListener("error", async () => {
    if (!speaking) return;
    const url = speaking.dataset.speech;
    stopSpeaking();
    notice(`Read aloud: ${await errorText(await fetch(url))}`);
  });
  async function toggleSpeak(button) {
    const again = speaking === button;
    stopSpeaking();
    if (again || await missing("speech")) return;
    speaking = button;
    button.textContent = "Stop";
    button.setAttribute("aria-pressed", "true");
    player.src = button.dataset.speech;
    player.play().catch(() => {});
  }
  document.addEventListener("click", (e) => {
    const t = e.target instanceof Element ? e.target.closest("#mic, .speak") : null;
    if (t && t.id === "mic") toggleMic();
    else if (t) toggleSpeak(t);
  });
})();
