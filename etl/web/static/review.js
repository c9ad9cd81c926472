// Keyboard shortcuts for the review pages (no build step, no inline script: the page's CSP
// allows only this file). Keys do nothing while typing in a field, except Ctrl+Enter and Esc.
"use strict";
(function () {
  const typing = (el) => el && (el.tagName === "INPUT" || el.tagName === "TEXTAREA" || el.tagName === "SELECT");
  const rows = () => Array.from(document.querySelectorAll("#queue tr.row"));
  let selected = -1;
  function select(index) {
    const all = rows();
    if (!all.length) return;
    selected = Math.max(0, Math.min(all.length - 1, index));
    all.forEach((row, i) => row.classList.toggle("selected", i === selected));
    all[selected].scrollIntoView({block: "nearest"});
  }
  function submit(id) {
    const form = document.getElementById(id);
    if (form) form.requestSubmit();
  }
  document.addEventListener("keydown", (event) => {
    const help = document.getElementById("help");
    if (event.key === "Escape") {
      if (help && !help.hidden) help.hidden = true;
      if (typing(document.activeElement)) document.activeElement.blur();
      return;
    }
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      if (document.getElementById("correct")) { event.preventDefault(); submit("correct"); }
      return;
    }
    if (typing(document.activeElement) || event.ctrlKey || event.metaKey || event.altKey) return;
    if (event.key === "?") { if (help) help.hidden = !help.hidden; return; }
    if (rows().length) {
      if (event.key === "j") { select(selected + 1); return; }
      if (event.key === "k") { select(selected - 1); return; }
      if (event.key === "Enter" && selected >= 0) { window.location.href = rows()[selected].dataset.href; return; }
    }
    if (event.key === "a") { event.preventDefault(); submit("accept"); }
    else if (event.key === "s") { event.preventDefault(); submit("skip"); }
    else if (event.key === "e") {
      const first = document.querySelector("#correct input:not([type=hidden]), #correct select, #correct textarea");
      if (first) { event.preventDefault(); first.focus(); if (first.select) first.select(); }
    }
  });
  // A field's row and its highlight light up together.
  function light(path, on) {
    document.querySelectorAll("mark.span").forEach((mark) => {
      if (mark.dataset.paths.split(" ").includes(path)) mark.classList.toggle("lit", on);
    });
  }
  document.querySelectorAll("table.values tr[data-path]").forEach((row) => {
    row.addEventListener("mouseenter", () => light(row.dataset.path, true));
    row.addEventListener("mouseleave", () => light(row.dataset.path, false));
    row.addEventListener("click", () => {
      const mark = Array.from(document.querySelectorAll("mark.span")).find((m) => m.dataset.paths.split(" ").includes(row.dataset.path));
      if (mark) mark.scrollIntoView({block: "center"});
    });
  });
  // A submitted form cannot be sent twice by a double click (the server writes one row anyway).
  document.querySelectorAll("form[method=post]").forEach((form) => {
    form.addEventListener("submit", () => form.querySelectorAll("button").forEach((b) => { b.disabled = true; }));
  });
  document.querySelectorAll("#queue tr.row").forEach((row, i) => row.addEventListener("click", (event) => {
    if (event.target.tagName !== "A") window.location.href = row.dataset.href;
  }));
  if (rows().length) select(0);
  // The keys work from here on (a test waits for it, as a person never needs to).
  document.documentElement.dataset.keys = "ready";
})();
