// MathJax 2.7, served from this site (docs/_tools/hooks.py copies it from the jupyter-server-mathjax package, which
// ships its combined TeX configuration): the math of pymdownx.arithmatex (generic mode: \( \) inline, \[ \] display,
// in elements of class "arithmatex").
window.MathJax = {
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: false,
    ignoreClass: ".*",
    processClass: "arithmatex",
  },
  "HTML-CSS": { availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null },
  showMathMenu: false,
  messageStyle: "none",
};
