// The console's only script: refresh the overview in place, and "select all" on the DLQ page.
(function () {
  "use strict";

  function refresh(box) {
    var every = parseInt(box.getAttribute("data-every"), 10) || 3000;
    function tick() {
      fetch(box.getAttribute("data-refresh"), { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.text(); })
        .then(function (html) { box.innerHTML = html; })
        .catch(function () { /* the next tick tries again */ })
        .finally(function () { window.setTimeout(tick, every); });
    }
    window.setTimeout(tick, every);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(refresh);
    var all = document.getElementById("select-all");
    if (all) {
      all.addEventListener("change", function () {
        document.querySelectorAll("input.pick").forEach(function (box) { box.checked = all.checked; });
      });
    }
    var matching = document.getElementById("replay-matching-button");
    if (matching) {
      matching.addEventListener("click", function (event) {
        if (!window.confirm("Replay every DLQ record matching the filter?")) { event.preventDefault(); }
      });
    }
  });
})();
