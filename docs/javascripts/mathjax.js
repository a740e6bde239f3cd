// MathJax for pymdownx.arithmatex (generic mode): only its \( ... \) and \[ ... \] spans are typeset.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
document$.subscribe(() => { if (window.MathJax.typesetPromise) { MathJax.typesetPromise(); } });
