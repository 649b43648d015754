// Syntax highlighting for the languages models write most: Python, JavaScript and TypeScript, JSON, shell, C and C++.
// Hand-written, since a library would be the largest file of the page for what a few rules per language do here.
// Each language is an ordered list of token rules joined into one regular expression; at each place the first rule
// that matches wins (so a keyword inside a string stays string), and text between tokens stays plain. Words are
// looked up in the language's keyword, literal and builtin sets, and a word before "(" is a function. The result is
// DOM nodes: spans whose text is the code's own text, so highlighting never turns model output into markup.

const END = "(?![\\s\\S])"; // the end of the code (an unterminated string or comment runs to it)
const BLOCK_COMMENT = `/\\*[\\s\\S]*?(?:\\*/|${END})`;
const LINE_COMMENT = "//[^\\n]*";
const DQ = '"(?:\\\\.|[^"\\\\\\n])*"?';
const SQ = "'(?:\\\\.|[^'\\\\\\n])*'?";
const EXPONENT = "(?:[eE][+-]?\\d+)?";
const C_NUMBER = `\\b(?:0[xX][\\da-fA-F']+|0[bB][01']+|\\d[\\d']*(?:\\.[\\d']*)?${EXPONENT})[uUlLfFzZ]*`
  + `|\\.\\d+${EXPONENT}[fFlL]?`;
const JS_NUMBER = `\\b(?:0[xXoObB][\\da-fA-F_]+n?|\\d[\\d_]*(?:\\.[\\d_]*)?${EXPONENT}n?)|\\.\\d+${EXPONENT}`;
const PY_NUMBER = `\\b(?:0[xXoObB][\\da-fA-F_]+|\\d[\\d_]*(?:\\.[\\d_]*)?${EXPONENT}j?)|\\.\\d+${EXPONENT}j?`;
const PY_STRING = `(?:\\b[rRbBuUfF]{1,2})?(?:"""[\\s\\S]*?(?:"""|${END})|'''[\\s\\S]*?(?:'''|${END})|${DQ}|${SQ})`;

const words = (text) => new Set(text.split(/\s+/));

const JS_KEYWORDS = "async await break case catch class const continue debugger default delete do else export extends "
  + "finally for from function if import in instanceof let new of return static super switch this throw try typeof "
  + "var void while with yield as get set";
const JS_BUILTINS = "console Math JSON Promise Object Array String Number Boolean Map Set Symbol Error RegExp Date "
  + "document window globalThis require module process";
const C_KEYWORDS = "auto break case char const continue default do double else enum extern float for goto if inline "
  + "int long register restrict return short signed sizeof static struct switch typedef union unsigned void volatile "
  + "while bool _Bool";
const CPP_KEYWORDS = " alignas alignof asm catch class concept constexpr consteval constinit co_await co_return "
  + "co_yield decltype delete explicit export final friend mutable namespace new noexcept operator override private "
  + "protected public requires static_assert template this thread_local throw try typeid typename using virtual";
const C_BUILTINS = "size_t ssize_t ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t FILE "
  + "printf fprintf sprintf snprintf malloc calloc realloc free memcpy memset strlen std string vector map "
  + "unique_ptr shared_ptr cout cerr endl";

const JS = {
  rules: [["comment", `${LINE_COMMENT}|${BLOCK_COMMENT}`], ["string", `${DQ}|${SQ}|\`(?:\\\\[\\s\\S]|[^\`\\\\])*\`?`],
          ["number", JS_NUMBER]],
  keywords: words(JS_KEYWORDS), literals: words("true false null undefined NaN Infinity"), builtins: words(JS_BUILTINS),
};

const C = {
  rules: [["comment", `${LINE_COMMENT}|${BLOCK_COMMENT}`], ["meta", "^[ \\t]*#[ \\t]*\\w+"],
          ["string", `(?<=#[ \\t]*include[ \\t]*)<[^>\\n]*>|(?:u8|[uUL])?${DQ}|(?:u8|[uUL])?${SQ}`],
          ["number", C_NUMBER]],
  keywords: words(C_KEYWORDS), literals: words("true false NULL"), builtins: words(C_BUILTINS),
};

const LANGUAGES = {
  python: {
    rules: [["comment", "#[^\\n]*"], ["string", PY_STRING], ["meta", "^[ \\t]*@[\\w.]+"], ["number", PY_NUMBER]],
    keywords: words("and as assert async await break class continue def del elif else except finally for from global "
                    + "if import in is lambda match case nonlocal not or pass raise return try while with yield"),
    literals: words("True False None"),
    builtins: words("print len range int str float bytes list dict set tuple bool open type isinstance super "
                    + "enumerate zip map filter sorted reversed min max sum abs any all iter next self cls object"),
  },
  javascript: JS,
  typescript: {
    ...JS,
    keywords: words(JS_KEYWORDS + " interface type enum implements namespace declare readonly private protected "
                    + "public abstract keyof infer is satisfies"),
    builtins: words(JS_BUILTINS + " string number boolean any unknown never object bigint Record Partial"),
  },
  json: {
    rules: [["property", `"(?:\\\\.|[^"\\\\\\n])*"(?=\\s*:)`], ["string", DQ],
            ["number", "-?\\b\\d+(?:\\.\\d+)?(?:[eE][+-]?\\d+)?"]],
    keywords: new Set(), literals: words("true false null"), builtins: new Set(),
  },
  bash: {
    rules: [["comment", "(?<![^\\s;|&(])#[^\\n]*"], ["string", `"(?:\\\\[\\s\\S]|[^"\\\\])*"?|'[^']*'?`],
            ["variable", "\\$(?:\\{[^}\\n]*\\}?|\\w+|[@*#?$!0-9-])"], ["option", "(?<=\\s)--?[A-Za-z][\\w-]*"]],
    keywords: words("if then else elif fi for while until do done case esac in function return local export "
                    + "select break continue"),
    word: "[A-Za-z_][\\w-]*",
    literals: words("true false"),
    builtins: words("echo cd printf read source set unset exit test alias eval exec shift trap cat grep sed awk ls "
                    + "rm cp mv mkdir chmod sudo pip python python3 git curl make"),
  },
  c: C,
  cpp: { ...C, keywords: words(C_KEYWORDS + CPP_KEYWORDS), literals: words("true false NULL nullptr") },
};

const ALIASES = {
  py: "python", python3: "python", js: "javascript", jsx: "javascript", mjs: "javascript", cjs: "javascript",
  node: "javascript", ts: "typescript", tsx: "typescript", jsonc: "json", sh: "bash", shell: "bash", zsh: "bash",
  console: "bash", h: "c", "c++": "cpp", cc: "cpp", cxx: "cpp", hpp: "cpp", hh: "cpp", hxx: "cpp",
};

const WORD = "[A-Za-z_$][\\w$]*";
const CALL = /\s*\(/y;
const compiled = new Map();

// The language a fence's info string names ("py", "C++", "typescript"), or null for one not highlighted.
export function languageOf(info) {
  const name = String(info ?? "").toLowerCase();
  const lang = ALIASES[name] ?? name;
  return Object.hasOwn(LANGUAGES, lang) ? lang : null;
}

function pattern(lang) {
  if (!compiled.has(lang)) {
    const rules = LANGUAGES[lang].rules;
    const word = LANGUAGES[lang].word ?? WORD;
    compiled.set(lang, new RegExp(rules.map(([, source]) => `(${source})`).join("|") + `|(${word})`, "gm"));
  }
  return compiled.get(lang);
}

function wordClass(spec, word, code, end) {
  if (spec.keywords.has(word)) return "keyword";
  if (spec.literals.has(word)) return "literal";
  if (spec.builtins.has(word)) return "builtin";
  CALL.lastIndex = end;
  return CALL.test(code) ? "function" : null;
}

function span(kind, text) {
  const node = document.createElement("span");
  node.className = "tok-" + kind;
  node.textContent = text;
  return node;
}

// `code` highlighted as `lang` (a name languageOf returned): a fragment of text nodes and spans of class tok-<kind>.
export function highlight(code, lang) {
  const spec = LANGUAGES[lang];
  const re = pattern(lang);
  const out = document.createDocumentFragment();
  let last = 0;
  re.lastIndex = 0;
  for (let m = re.exec(code); m; m = re.exec(code)) {
    if (!m[0]) {
      re.lastIndex += 1;
      continue;
    }
    const group = m.findIndex((g, i) => i > 0 && g !== undefined);
    const kind = group <= spec.rules.length ? spec.rules[group - 1][0]
      : wordClass(spec, m[0], code, m.index + m[0].length);
    if (!kind) continue;
    if (m.index > last) out.append(code.slice(last, m.index));
    out.append(span(kind, m[0]));
    last = m.index + m[0].length;
  }
  if (last < code.length) out.append(code.slice(last));
  return out;
}
