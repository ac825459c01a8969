// gridgate console: refresh the page's live part in place by polling its JSON endpoint
// (/console/api/<page>), which answers the data and the part rendered by the server. No dependencies.
"use strict";
(function () {
  var live = document.getElementById("live");
  var status = document.getElementById("refresh-status");
  if (!live) { return; }
  var url = live.getAttribute("data-refresh");
  var interval = parseInt(live.getAttribute("data-interval-ms"), 10) || 2000;
  var busy = false;
  var shown = null;  // the live part last swapped in: an unchanged one is left alone (a click in it lands)
  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (response) {
        if (response.status === 401) { window.location.assign("/console"); return null; }
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.json();
      })
      .then(function (answer) {
        if (answer === null) { return; }
        if (answer.html !== shown) {
          shown = answer.html;
          live.innerHTML = answer.html;  // rendered by the server with every value escaped
        }
        if (status) { status.textContent = "updated " + new Date().toLocaleTimeString(); }
      })
      .catch(function (error) {
        if (status) { status.textContent = "refresh failed (" + error.message + "); retrying"; }
      })
      .finally(function () { busy = false; });
  }
  window.setInterval(refresh, interval);
  document.addEventListener("visibilitychange", refresh);
  // Forms that change something irreversibly ask first.
  document.addEventListener("submit", function (event) {
    var question = event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) { event.preventDefault(); }
  });
})();
