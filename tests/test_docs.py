"""The documentation against the repository and the code: README.md and docs/*.md.

Each check reports every problem it finds as ``page:line: what is wrong``.

* **Links.** Every relative link, ``[text](target)`` and ``![alt](target)``, resolves to a file or
  folder of the repository, taken relative to the page that holds it; every ``#anchor``, alone or after
  a file, is a heading of the target page under GitHub's anchor rules (``slug``; a repeated heading
  gets ``-1``, ``-2``, …). ``http(s)://`` and ``mailto:`` links are not followed; a link starting with
  ``/`` is refused (write it relative to the page). Code (fenced blocks and inline spans) holds no links.
* **This extension's flags.** Every ``--attn-…`` and ``--opt-…`` token anywhere in the docs is a flag
  ``preload.py`` defines (``FLAGS``): the docs name A1111's own optimizers by their dropdown names,
  never by flag, so each such token is one of ours. Every flag ``preload.py`` defines has a row in the
  README's flags table.
* **The hosts' own flags.** The host-flag table of docs/webuis.md is the table whose header has the
  column ``its flag``. In that column, every word in backticks that starts with ``--`` is a flag the
  code reads: the first word of a spelling in ``webui_attn.settings.flags.HOST_FLAGS`` (``--sage2-function
  fp16_triton`` is the flag ``--sage2-function`` given the value ``fp16_triton``) or a spelling in
  ``host_attn.startup_flags.FLAGS``; every other word in backticks there is a value such a flag takes
  (``HostFlag.value``). Every flag the code reads has a place in that column.
* **Setting keys.** Every ``flash_attn_…`` token is a key of ``webui_attn.settings.stored`` (``DEFAULTS``
  or ``KEY_AVAILABILITY``), unless the backends in ``lib_attn/kernels/`` name it in their source: those
  are the flash-attn packages' own modules and functions (``flash_attn_interface``, ``flash_attn_func``).
* **Environment variables.** Every ``ATTN_…`` / ``LIB_ATTN_…`` token is a word of some .py file of the
  product (any outside tests/, hidden folders and build output).
* **Engine names.** Every ``lib_attn.X.Y…`` reference resolves (the longest importable module, then
  attributes); every token in an inline code span that looks like a backend id
  (``BACKEND_ID_SHAPE``) is a registered id (``lib_attn.BACKEND_IDS``) or a distribution some backend
  probes (``lib_attn.backends()[i].packages``); every ``python -m lib_attn COMMAND --option`` (and every
  code span that starts ``doctor``/``bench``/``tune`` followed by an option) names a subcommand of
  ``lib_attn.commands.cli.build_parser()`` and options of that subcommand, and a value given to an
  option with fixed choices (``--model sd15|sdxl``) is one of them.
"""
import argparse
import glob
import importlib
import importlib.util
import os
import re
import unicodedata
from urllib.parse import unquote

import pytest

import lib_attn
from host_attn import startup_flags
from lib_attn.commands.cli import build_parser
from webui_attn.routing.a1111 import A1111_FLAGS
from webui_attn.settings import flags as settings_flags
from webui_attn.settings import stored

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_paths() -> list:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def docs() -> list:
    """(path, text) of every page the checks cover."""
    return [(p, read(p)) for p in doc_paths()]


def where(path: str, text: str, offset: int) -> str:
    return f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, offset) + 1}"


# --- markdown: code, headings, anchors ----------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
#: An inline code span: a run of backticks, then text up to the same run (within one paragraph).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)


def fenced_ranges(text: str) -> list:
    """(start, end) offsets of each fenced code block, fences included."""
    ranges, start, fence, offset = [], None, None, 0
    for line in text.splitlines(keepends=True):
        m = FENCE.match(line)
        if start is None and m:
            start, fence = offset, m.group(1)
        elif start is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            ranges.append((start, offset + len(line)))
            start = None
        offset += len(line)
    if start is not None:
        ranges.append((start, len(text)))
    return ranges


def blank(text: str, ranges) -> str:
    """``text`` with each range's characters but newlines turned to spaces: offsets and lines stay."""
    chars = list(text)
    for start, end in ranges:
        for i in range(start, end):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def without_fences(text: str) -> str:
    return blank(text, fenced_ranges(text))


def code_spans(text: str) -> list:
    """(offset, content) of each inline code span outside fenced blocks."""
    return [(m.start(), m.group(2)) for m in CODE_SPAN.finditer(without_fences(text))]


def inline_ranges(text: str) -> list:
    """(start, end) of each inline code span outside fenced blocks, backticks included."""
    return [(m.start(), m.end()) for m in CODE_SPAN.finditer(without_fences(text))]


def prose(text: str) -> str:
    """``text`` without its code, fenced or inline, at the same offsets."""
    return blank(without_fences(text), inline_ranges(text))


HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")


def rendered(heading: str) -> str:
    """A heading's text as GitHub renders it: code spans keep their text, links their label, and the
    emphasis marks go."""
    out, last = [], 0
    for m in CODE_SPAN.finditer(heading):
        out.append(_plain(heading[last:m.start()]))
        out.append(m.group(2).strip() if m.group(2).strip() else m.group(2))
        last = m.end()
    out.append(_plain(heading[last:]))
    return "".join(out)


def _plain(text: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("*", "")
    return re.sub(r"(?<![0-9A-Za-z])_+|_+(?![0-9A-Za-z])", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case; every character but letters, marks and digits of any
    script, connector punctuation (``_``), hyphens and spaces removed; each space a hyphen."""
    text = rendered(heading).strip().lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(text: str) -> list:
    """The anchors of a page's headings in order, repeated ones numbered as GitHub numbers them."""
    seen, out = {}, []
    for m in HEADING.finditer(without_fences(text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append(base if n == 0 else f"{base}-{n}")
    return out


# --- links ----------------------------------------------------------------------------------------------

def link_problems(pages) -> list:
    """Every relative link of ``pages`` ((path, text) pairs) that does not resolve, and why."""
    problems = []
    anchor_cache = {}

    def anchors_of(path):
        if path not in anchor_cache:
            anchor_cache[path] = set(anchors(read(path)))
        return anchor_cache[path]

    texts = {os.path.abspath(p): t for p, t in pages}
    for path, text in pages:
        for m in LINK.finditer(prose(text)):
            target = m.group(2).strip("<>")
            at = where(path, text, m.start())
            if not target:
                problems.append(f"{at}: empty link target in {m.group(0)!r}")
                continue
            if re.match(r"(?i)(https?:|mailto:)", target):
                continue
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):
                problems.append(f"{at}: {target!r}: not a relative link (only http(s) and mailto are allowed)")
                continue
            if target.startswith("/"):
                problems.append(f"{at}: {target!r}: write the path relative to the page")
                continue
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part.split("?")[0])
            resolved = os.path.abspath(os.path.join(os.path.dirname(path), file_part)) if file_part else os.path.abspath(path)
            if os.path.commonpath([resolved, ROOT]) != ROOT:
                problems.append(f"{at}: {target!r} points outside the repository")
                continue
            if not os.path.exists(resolved) and resolved not in texts:
                problems.append(f"{at}: {target!r}: no such file {os.path.relpath(resolved, ROOT)}")
                continue
            if not anchor:
                continue
            anchor = unquote(anchor)
            if resolved.endswith(".md") and (resolved in texts or os.path.isfile(resolved)):
                names = set(anchors(texts[resolved])) if resolved in texts else anchors_of(resolved)
                if anchor not in names:
                    problems.append(f"{at}: {target!r}: no heading with the anchor #{anchor} in "
                                    f"{os.path.relpath(resolved, ROOT)}")
            elif not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                problems.append(f"{at}: {target!r}: #{anchor} is not a heading anchor (only .md pages have headings)")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = link_problems(docs())
    assert problems == [], "broken links:\n" + "\n".join(problems)


def test_the_screenshot_is_linked_from_the_readme():
    readme = read(os.path.join(ROOT, "README.md"))
    targets = [m.group(2) for m in LINK.finditer(prose(readme)) if m.group(0).startswith("!")]
    assert "docs/images/a1111-accordion.png" in targets
    assert "docs/panel.png" not in readme


SLUGS = [
    # (page, heading as written, GitHub's anchor)
    ("docs/engine-api.md", "Engine API (`lib_attn`)", "engine-api-lib_attn"),
    ("docs/webuis.md", "Forge and its lines (Forge Neo, reForge, Forge Classic)",
     "forge-and-its-lines-forge-neo-reforge-forge-classic"),
    ("docs/webuis.md", "A1111: Cross attention optimization", "a1111-cross-attention-optimization"),
    ("docs/webuis.md", "The hosts' own attention flags", "the-hosts-own-attention-flags"),
    ("docs/troubleshooting.md", "`undefined symbol: _ZN3c10…` when flash-attn or xformers loads",
     "undefined-symbol-_zn3c10-when-flash-attn-or-xformers-loads"),
    ("docs/troubleshooting.md", "\"Torch was not compiled with flash attention\" on Windows",
     "torch-was-not-compiled-with-flash-attention-on-windows"),
    ("docs/development.md", "Test doubles, GPU tests and the docs check", "test-doubles-gpu-tests-and-the-docs-check"),
    ("docs/doctor-and-bench.md", "`bench`", "bench"),
]


@pytest.mark.parametrize("page, heading, expected", SLUGS)
def test_slug_follows_githubs_rules_on_the_docs_headings(page, heading, expected):
    assert slug(heading) == expected
    written = [m.group(2) for m in HEADING.finditer(without_fences(read(os.path.join(ROOT, page))))]
    assert heading in written, f"{page} has no heading {heading!r}"


def test_slug_edge_cases():
    assert slug("A / B. C") == "a--b-c"                   # '/' and '.' go, both spaces stay
    assert slug("Über **bold** _x_ and `a_b`") == "über-bold-x-and-a_b"
    assert slug("[linked](x.md) title") == "linked-title"
    assert slug("Größe: 2.x — ok?") == "größe-2x--ok"
    assert anchors("# A\n## A\n```\n# A\n```\n### A\n") == ["a", "a-1", "a-2"]


def test_the_link_check_finds_what_is_broken():
    page = os.path.join(ROOT, "docs", "planted.md")
    text = ("# Top\n\n[ok](#top) [self](planted.md#top) [bad anchor](#nowhere) [gone](missing.md)\n"
            "[far](../README.md#no-such-heading) [abs](/docs/README.md) `[in code](missing.md)`\n"
            "![img](images/none.png) [web](https://example.com) [mail](mailto:a@b.c)\n"
            "```\n[fenced](missing2.md)\n```\n")
    problems = link_problems([(page, text)])
    assert len(problems) == 5, problems
    assert "#nowhere" in problems[0] and "missing.md" in problems[1]
    assert "no-such-heading" in problems[2] and "relative to the page" in problems[3]
    assert "images/none.png" in problems[4]
    assert all(p.startswith("docs/planted.md:") for p in problems)


# --- this extension's flags, the hosts' flags, settings, environment ----------------------------------

def preload_flags() -> list:
    spec = importlib.util.spec_from_file_location("flash_attention_preload_for_docs", os.path.join(ROOT, "preload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [flag for flag, _ in module.FLAGS]


OUR_FLAG = re.compile(r"(?<![\w-])--(?:attn|opt)-[a-z0-9]+(?:-[a-z0-9]+)*")


def our_flag_problems(pages, defined) -> list:
    return [f"{where(p, t, m.start())}: {m.group(0)} is not a flag preload.py defines"
            for p, t in pages for m in OUR_FLAG.finditer(t) if m.group(0) not in defined]


def test_every_flag_of_ours_the_docs_cite_exists():
    """Ours, or one of A1111's own attention flags (whose effect on the extension the docs explain)."""
    problems = our_flag_problems(docs(), set(preload_flags()) | {spelling for _, spelling, _ in A1111_FLAGS})
    assert problems == [], "\n".join(problems)


def test_every_flag_of_ours_is_in_the_readme_flags_table():
    readme = read(os.path.join(ROOT, "README.md"))
    rows = {m.group(1) for m in re.finditer(r"^\|\s*`(--[a-z0-9-]+)", readme, re.M)}
    assert [f for f in preload_flags() if f not in rows] == []


def test_the_flag_check_finds_an_unknown_flag():
    pages = [(os.path.join(ROOT, "README.md"), "use `--attn-backend` or\n--attn-bakend x, not --opt-* or --attn-")]
    assert our_flag_problems(pages, set(preload_flags())) == ["README.md:2: --attn-bakend is not a flag preload.py defines"]


def host_flags_known() -> tuple:
    """(flags the code reads, values those flags take)."""
    spellings = {f.spelling.split()[0] for group in settings_flags.HOST_FLAGS.values() for f in group}
    spellings |= {spelling for spelling, _, _ in startup_flags.FLAGS.values()}
    values = {f.value for group in settings_flags.HOST_FLAGS.values() for f in group if f.value}
    return spellings, values


def host_flag_column(text: str) -> list:
    """(offset, cell) of the ``its flag`` column of the host-flag table, one per row."""
    lines = text.splitlines(keepends=True)
    offset, column, cells = 0, None, []
    for line in lines:
        parts = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if column is None and parts and "its flag" in parts:
            column = parts.index("its flag")
        elif column is not None:
            if parts is None:
                break
            if not set(line.strip()) <= set("|-: "):
                cells.append((offset, parts[column] if column < len(parts) else ""))
        offset += len(line)
    return cells


def host_flag_problems(path: str, text: str) -> list:
    spellings, values = host_flags_known()
    cells = host_flag_column(text)
    if not cells:
        return [f"{os.path.relpath(path, ROOT)}: no table with an 'its flag' column"]
    problems, named = [], set()
    for offset, cell in cells:
        for _, span in code_spans(cell):
            for word in span.split():
                if word.startswith("--"):
                    named.add(word)
                    if word not in spellings:
                        problems.append(f"{where(path, text, offset)}: {word} is not a host flag the code reads "
                                        f"(HOST_FLAGS, startup_flags.FLAGS)")
                elif word not in values:
                    problems.append(f"{where(path, text, offset)}: {word!r} is no value of a host flag the code reads")
    problems += [f"{os.path.relpath(path, ROOT)}: the host-flag table lacks {s}, which the code reads"
                 for s in sorted(spellings - named)]
    return problems


def test_every_host_flag_in_the_table_is_one_the_code_reads():
    path = os.path.join(ROOT, "docs", "webuis.md")
    problems = host_flag_problems(path, read(path))
    assert problems == [], "\n".join(problems)


def test_the_host_flag_check_finds_a_wrong_flag():
    path = os.path.join(ROOT, "docs", "webuis.md")
    text = "| host | its flag | x |\n|---|---|---|\n| Neo | `--disable-sage`, `--sagee` `fp9_cuda` | y |\n"
    problems = host_flag_problems(path, text)
    assert problems[:2] == ["docs/webuis.md:3: --sagee is not a host flag the code reads (HOST_FLAGS, startup_flags.FLAGS)",
                            "docs/webuis.md:3: 'fp9_cuda' is no value of a host flag the code reads"]
    assert "--attention-pytorch" in "".join(problems[2:])


SETTING = re.compile(r"(?<![\w])flash_attn_[a-z0-9_]*[a-z0-9]")


def kernel_names() -> set:
    names = set()
    for path in glob.glob(os.path.join(ROOT, "lib_attn", "kernels", "*.py")):
        names.update(re.findall(r"flash_attn_\w+", read(path)))
    return names


def setting_problems(pages) -> list:
    keys = set(stored.DEFAULTS) | {stored.KEY_AVAILABILITY}
    exempt = kernel_names()
    return [f"{where(p, t, m.start())}: {m.group(0)} is not a setting key (webui_attn/settings/stored.py)"
            for p, t in pages for m in SETTING.finditer(t) if m.group(0) not in keys and m.group(0) not in exempt]


def test_every_setting_key_the_docs_cite_exists():
    problems = setting_problems(docs())
    assert problems == [], "\n".join(problems)


def test_the_setting_check_finds_an_unknown_key():
    pages = [(os.path.join(ROOT, "README.md"), "`flash_attn_backend`, `flash_attn_interface`, `flash_attn_`\n`flash_attn_vae`")]
    assert setting_problems(pages) == ["README.md:2: flash_attn_vae is not a setting key (webui_attn/settings/stored.py)"]


ENV = re.compile(r"(?<![A-Za-z0-9_])(?:LIB_)?ATTN_[A-Z0-9_]*[A-Z0-9]")


def product_words() -> set:
    words = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__", "node_modules",
                                                                          "build", "dist")
                   and not d.endswith(".egg-info")]
        for file in files:
            if file.endswith(".py"):
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", read(os.path.join(folder, file))))
    return words


def env_problems(pages, words) -> list:
    return [f"{where(p, t, m.start())}: {m.group(0)} appears in no .py file of the product"
            for p, t in pages for m in ENV.finditer(t) if m.group(0) not in words]


def test_every_environment_variable_the_docs_cite_is_read_by_the_code():
    problems = env_problems(docs(), product_words())
    assert problems == [], "\n".join(problems)


def test_the_environment_check_finds_an_unknown_variable():
    pages = [(os.path.join(ROOT, "README.md"), "`ATTN_INSTALL=sage` and `LIB_ATTN_CACHE_DIR`\n`ATTN_INSTAL=sage`")]
    assert env_problems(pages, product_words()) == ["README.md:2: ATTN_INSTAL appears in no .py file of the product"]


# --- engine names ---------------------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w.])lib_attn(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def unresolved(dotted: str):
    """Why ``dotted`` names nothing (None when it resolves): the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                continue
            return f"importing {name} failed: {exc}"
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:parts.index(attr, i)])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def dotted_problems(pages) -> list:
    problems = []
    for p, t in pages:
        for m in DOTTED.finditer(t):
            why = unresolved(m.group(0))
            if why:
                problems.append(f"{where(p, t, m.start())}: {m.group(0)}: {why}")
    return problems


def test_every_lib_attn_reference_resolves():
    problems = dotted_problems(docs())
    assert problems == [], "\n".join(problems)


def test_the_reference_check_finds_a_wrong_name():
    pages = [(os.path.join(ROOT, "README.md"), "`lib_attn.configure`, lib_attn.commands.doctor.report.\n"
                                               "`lib_attn.confgure` and lib_attn.commands.doctr")]
    problems = dotted_problems(pages)
    assert problems == ["README.md:2: lib_attn.confgure: lib_attn has no attribute 'confgure'",
                        "README.md:2: lib_attn.commands.doctr: lib_attn.commands has no attribute 'doctr'"]


#: What a backend id looks like: a token in an inline code span that matches this is checked.
BACKEND_ID_SHAPE = re.compile(r"(sdpa|sage|flash-attn|xformers|math)(-[a-z0-9]+)*")
TOKEN_SPLIT = re.compile(r"[\s,;:()\[\]{}=\"'|+×·]+")


def backend_names() -> set:
    names = set(lib_attn.BACKEND_IDS)
    for info in lib_attn.backends():
        names.update(info.packages)
    return names


def backend_id_problems(pages) -> list:
    known = backend_names()
    problems = []
    for p, t in pages:
        for offset, span in code_spans(t):
            for token in TOKEN_SPLIT.split(span):
                if BACKEND_ID_SHAPE.fullmatch(token) and token not in known:
                    problems.append(f"{where(p, t, offset)}: `{token}` is neither a backend id nor a distribution a "
                                    f"backend probes")
    return problems


def test_every_backend_id_the_docs_cite_is_registered():
    problems = backend_id_problems(docs())
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("command", ["doctor", "bench"])
def test_the_command_page_names_every_option_help_lists(command):
    import argparse
    from lib_attn.commands import cli
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [a.option_strings[0] for a in sub.choices[command]._actions
               if a.option_strings and a.help is not argparse.SUPPRESS and a.option_strings[0] != "-h"]
    page = open(os.path.join(ROOT, "docs", "doctor-and-bench.md"), encoding="utf-8").read()
    assert options and [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", page)] == []


def test_the_readmes_list_of_backend_ids_names_every_one():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start = text.index("Backend ids: ")
    listed = [span for _, span in code_spans(text[start:text.index("\n\n", start)])]
    assert [i for i in dict.fromkeys(listed) if i in lib_attn.BACKEND_IDS] == list(lib_attn.BACKEND_IDS)


def test_the_backend_id_check_finds_an_unknown_id():
    pages = [(os.path.join(ROOT, "README.md"), "`flash-attn,sdpa-cudnn`, `flash-attn-4`, `0-20%: sage; vae: math`\n"
                                               "`sdpa-fast`, `sage-fp4 2.2`")]
    problems = backend_id_problems(pages)
    assert [p.split(": ")[1] for p in problems] == ["`sdpa-fast` is neither a backend id nor a distribution a backend probes",
                                                    "`sage-fp4` is neither a backend id nor a distribution a backend probes"]


def subcommands() -> dict:
    """Each subcommand of ``python -m lib_attn``: {option string: its choices or None}."""
    parser = build_parser()
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = {o: a.choices for a in sub._actions for o in a.option_strings}
    return found


CLI = re.compile(r"python -m lib_attn(?:[ \t]+([A-Za-z][\w-]*))?([^\n#);]*)")
SYNOPSIS = re.compile(r"\s*(doctor|bench|tune)\s+\[?(--[^\n#);]*)")


def cli_uses(path: str, text: str) -> list:
    """(place, command, rest of the command line) of each ``python -m lib_attn COMMAND`` and each code
    span that starts with a command and an option."""
    found = []
    for offset, span in code_spans(text):
        flat = span.replace("\n", " ")
        for m in CLI.finditer(flat):
            if m.group(1):
                found.append((where(path, text, offset), m.group(1), m.group(2)))
        m = SYNOPSIS.match(flat)
        if m:
            found.append((where(path, text, offset), m.group(1), m.group(2)))
    outside = blank(text, inline_ranges(text))   # prose and fenced blocks
    for m in CLI.finditer(outside):
        if m.group(1):
            found.append((where(path, text, m.start()), m.group(1), m.group(2)))
    return found


def cli_problems(pages) -> list:
    commands = subcommands()
    problems = []
    for p, t in pages:
        for at, command, rest in cli_uses(p, t):
            if command not in commands:
                problems.append(f"{at}: python -m lib_attn {command}: no such command ({', '.join(commands)})")
                continue
            options = commands[command]
            for m in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:[ \t]+([^\s\[\]-][^\s\[\]]*))?", rest):
                option, value = m.groups()
                if option not in options:
                    problems.append(f"{at}: {command} has no option {option}")
                elif value and options[option]:
                    wrong = [v for v in value.split("|") if v not in ("…", "...") and v not in options[option]]
                    if wrong:
                        problems.append(f"{at}: {command} {option}: {', '.join(wrong)} not among "
                                        f"{', '.join(options[option])}")
    return problems


def test_every_lib_attn_command_and_option_the_docs_cite_exists():
    problems = cli_problems(docs())
    assert problems == [], "\n".join(problems)


def test_the_command_check_finds_a_wrong_command_option_or_value():
    pages = [(os.path.join(ROOT, "README.md"),
              "`python -m lib_attn bench --model sd15 --res 192` `tune [--model sd15|…|all]`\n"
              "`python -m lib_attn bench --modle sd15` `python -m lib_attn doctr`\n"
              "python -m lib_attn tune --model sd9  # a comment --not-an-option\n"
              "`doctor [--json] [--dtyp fp16]`\n")]
    assert cli_problems(pages) == [
        "README.md:2: bench has no option --modle",
        "README.md:2: python -m lib_attn doctr: no such command (doctor, bench, tune, parallel)",
        "README.md:4: doctor has no option --dtyp",
        "README.md:3: tune --model: sd9 not among sd15, sd2, sdxl, sd3, flux, vae, wan, hunyuan-video, all",
    ]
