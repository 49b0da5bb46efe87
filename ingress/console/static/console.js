// Live sections (data-live) are refreshed in place every few seconds from the same page,
// without a reload, unless the user is typing in a form.
(function () {
  "use strict";
  var EVERY_MS = 5000;
  function refresh() {
    var active = document.activeElement;
    if (document.hidden || (active && active.form)) return;
    fetch(window.location.pathname, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (section) {
          var next = fresh.getElementById(section.id);
          if (next) section.replaceWith(document.importNode(next, true));
        });
      })
      .catch(function () { /* the next tick tries again */ });
  }
  setInterval(refresh, EVERY_MS);
})();
