// Live sections (data-live) are refreshed in place every few seconds from the same page,
// without a reload, unless the user is typing in a form. A refresh that fails, or that comes
// back without the live sections (the session ended: the login page), says so above them,
// with the time of the last good one, rather than leaving old numbers looking current.
(function () {
  "use strict";
  var EVERY_MS = 5000;
  // A page answered to a form (a new key) names the page it shows: a reload reads that one.
  var address = document.body.getAttribute("data-address");
  if (address && address !== window.location.pathname) {
    window.history.replaceState(null, "", address);
  }
  var lastGood = new Date();
  function stale(why) {
    var note = document.getElementById("stale");
    if (!note) {
      note = document.createElement("p");
      note.id = "stale";
      note.className = "error";
      var main = document.querySelector("main");
      main.insertBefore(note, main.firstChild);
    }
    note.textContent = "Not updated since " + lastGood.toLocaleTimeString() + ": " + why + ".";
    note.hidden = false;
  }
  function fresh() {
    lastGood = new Date();
    var note = document.getElementById("stale");
    if (note) note.hidden = true;
  }
  function refresh() {
    var active = document.activeElement;
    if (document.hidden || (active && active.form)) return;
    var live = document.querySelectorAll("[data-live][id]");
    if (!live.length) return;
    fetch(window.location.pathname, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) {
          stale("the console answered " + response.status + " (a backing service may be down)");
          return null;
        }
        return response.text();
      })
      .then(function (html) {
        if (html === null) return;
        var page = new DOMParser().parseFromString(html, "text/html");
        if (!page.querySelector("[data-live][id]")) {
          stale("the session ended; reload the page to log in again");
          return;
        }
        live.forEach(function (section) {
          var next = page.getElementById(section.id);
          if (next) section.replaceWith(document.importNode(next, true));
        });
        fresh();
      })
      .catch(function () { stale("the console is unreachable"); });
  }
  setInterval(refresh, EVERY_MS);
})();
