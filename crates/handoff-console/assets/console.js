// The console's one script, embedded in the binary: progressive enhancement only, every page
// works without it. The overview reloads itself while nobody is typing in it.
(function () {
  var main = document.querySelector("main[data-refresh]");
  if (!main) { return; }
  var seconds = parseInt(main.getAttribute("data-refresh"), 10) || 15;
  setInterval(function () {
    var active = document.activeElement;
    if (!active || (active.tagName !== "INPUT" && active.tagName !== "TEXTAREA")) {
      window.location.reload();
    }
  }, seconds * 1000);
})();
