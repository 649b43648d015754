// Light and dark: the page follows the system's colour scheme (prefers-color-scheme) unless the toggle picks light or
// dark, which the browser keeps. The style sheet's colours are light-dark() pairs; the choice sets the root's
// color-scheme through its data-theme attribute.

import { $, write } from "./dom.js";

const STORE = "jaxstation.theme";
const NEXT = { auto: "dark", dark: "light", light: "auto" };

function apply(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("theme").textContent = `Theme: ${theme}`;
  $("theme").title = theme === "auto" ? "following the system's setting" : `always ${theme}`;
}

export function wireTheme() {
  const saved = localStorage.getItem(STORE);
  apply(Object.hasOwn(NEXT, saved ?? "") ? saved : "auto");
  $("theme").addEventListener("click", () => {
    const theme = NEXT[document.documentElement.dataset.theme ?? "auto"];
    write(STORE, theme);
    apply(theme);
  });
}
