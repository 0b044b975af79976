"""The repository explains itself: the docs and the comments cite only what is in it, and say it as it is now.

- docs/params.md is the Param table as scripts/params_reference.py renders it (regenerate, never edit by hand);
- every repository path the docs, the README and the code's comments and strings cite exists;
- every relative Markdown link (and its #anchor) resolves;
- no comment cites a document kept outside the repository (the design notes), and none names a module by a
  name the package no longer has (the flat modules before the stage subpackages) or a `dflash_regen.` path
  that does not resolve.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "include" / "dflash_regen"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", ROOT / "bench" / "README.md", *DOCS]
THIS = Path(__file__).resolve()

# A repository path: a top folder of the repository (or a stage package inside include/dflash_regen/) and then
# more path; it stops at a placeholder such as `<node>` or a glob, which keeps the part before it checked.
TOP = r"(?:include|tests|scripts|docs|bench|deploy|dags|plugins|\.ci)"
REPO_PATH = re.compile(rf"(?<![\w./<>-]){TOP}/[\w./-]*[\w/]")
PACKAGE_PATH = re.compile(r"(?<![\w./<>=-])dflash_regen/[\w/]+\.(?:py|jinja|html|css)\b")
GENERATED = ("bench/results",)  # written by `make bench`, not committed
EXTERNAL = {"scripts/prepare_hidden_states.py"}  # SpecForge's own, named where our judge follows it
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Documents that live outside the repository; a comment must stand alone or cite a repo file instead.
OUTSIDE = re.compile("|".join([r"DESIGN(?:\.md| ?§)", r"\bnotes/", r"sglang-api\.md", r"cookbook §", r"§\s?\d"]))
# The flat modules before the stage subpackages. Distinct words: any mention is stale. English words: only as a
# module (`word.attribute`, `word.py`).
OLD_NAMES = ("run_report", "report_pages", "dag_tasks", "shard_status", "prompt_sources", "demo_prompts",
             "demo_model", "demo_summary", "sglang_http", "server_watch")
OLD_WORDS = ("generation", "generator", "probes", "tokenized", "emulated", "config")
FILE_SUFFIX = r"(?:json|jsonl|parquet|md|py|lock|log|html|css|gz|csv|yaml|jinja|sh|toml|txt|safetensors|fleet)\b"
OLD_WORD_AS_MODULE = re.compile(rf"(?<![\w./-])(?:{'|'.join(OLD_WORDS)})\.(?!{FILE_SUFFIX})[A-Za-z_]\w*"
                                rf"|(?<![\w/-])(?:{'|'.join(OLD_WORDS)})\.py\b")
OLD_NAME = re.compile(rf"(?<![\w./-])(?:{'|'.join(OLD_NAMES)})\b")
NOT_MODULES = {"generation.by_source_run"}  # a manifest key
# `package.name` where the package is one of ours must name a module of it or a name its __init__ defines; these
# are someone else's: SGLang's own package, OpenAI's object type, an Airflow task's method.
PACKAGES = ("settings", "sglang", "chat", "prompts", "fleet", "capacity", "generate", "training", "ui", "demo",
            "emulator")
PACKAGE_ATTR = re.compile(rf"(?<![\w./-])(?:{'|'.join(PACKAGES)})\.(?!{FILE_SUFFIX})[A-Za-z_]\w*")
FOREIGN = {"sglang.srt", "sglang.launch_server", "sglang.__version__", "chat.completion", "generate.expand"}
DOTTED = re.compile(r"\bdflash_regen(?:\.\w+)+")


def _tracked() -> list[Path]:
    """The repository's files (git's view: tracked and new, not ignored); without git, the source folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [p for top in ("include", "dags", "plugins", "tests", "scripts", "bench", "deploy")
                for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


SOURCES = [p for p in _tracked() if p.suffix in (".py", ".sh", ".html", ".jinja", ".yaml", ".toml", "")
           and p.resolve() != THIS and p.name != "requirements.lock"]


def _prose_of(path: Path) -> str:
    """What a file says in words: a Python file's comments and strings, any other file whole."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return text
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
        elif tok.type == tokenize.STRING:  # an f-string's {fields} are code
            fstring = re.match(r"^[rbuRBU]*[fF]", tok.string)
            parts.append(re.sub(r"\{[^{}]*\}", "", tok.string) if fstring else tok.string)
    return "\n".join(parts)


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------- params.md
def test_the_param_reference_is_current():
    spec = importlib.util.spec_from_file_location("params_reference", ROOT / "scripts" / "params_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "params.md").read_text()
    assert current == module.render(), ("docs/params.md is not the Param table's: regenerate it with "
                                        "`.venv/bin/python scripts/params_reference.py > docs/params.md`")


# ------------------------------------------------------------------------------------------ cited paths
def _cited_paths(text: str) -> set[str]:
    found = {m.group(0).rstrip(".") for m in REPO_PATH.finditer(text)}
    found |= {"include/" + m.group(0).rstrip(".") for m in PACKAGE_PATH.finditer(text)}
    return {p for p in found if not p.startswith(GENERATED) and p not in EXTERNAL}


@pytest.mark.parametrize("path", [*MARKDOWN, *SOURCES], ids=_where)
def test_every_cited_repository_path_exists(path):
    text = path.read_text(errors="replace") if path.suffix == ".md" else _prose_of(path)
    missing = sorted(p for p in _cited_paths(text) if not (ROOT / p).exists())
    assert not missing, f"{_where(path)} cites paths that are not in the repository: {missing}"


# ------------------------------------------------------------------------------------------ Markdown links
def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("path", MARKDOWN, ids=_where)
def test_every_relative_markdown_link_resolves(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in MD_LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # an absolute URL
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{_where(path)} has links that do not resolve: {broken}"


# A section cited by name: `docs/operations.md, "Reuse across runs"` or `README "Several nodes"`.
SECTION = re.compile(r"""\b((?:docs/[\w-]+\.md)|README(?:\.md)?),? \(?["'](?!\s)([^"'\n]{3,60})["']""")


def _headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {h.strip() for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", [*MARKDOWN, *SOURCES], ids=_where)
def test_every_cited_section_exists(path):
    text = path.read_text(errors="replace") if path.suffix == ".md" else _prose_of(path)
    missing = []
    for page, title in SECTION.findall(text):
        target = ROOT / ("README.md" if page.startswith("README") else page)
        if target.is_file() and title not in _headings(target):
            missing.append(f"{page} {title!r}")
    assert not missing, f"{_where(path)} cites sections that do not exist: {missing}"


def test_the_docs_folder_has_its_pages_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for page in ("architecture", "operations", "sglang-versions", "capacity", "params", "testing"):
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
        assert f"docs/{page}.md" in readme, f"README.md does not link docs/{page}.md"


# ------------------------------------------------------------------------------------------ comments
@pytest.mark.parametrize("path", [*MARKDOWN, *SOURCES], ids=_where)
def test_no_comment_cites_a_document_outside_the_repository(path):
    text = path.read_text(errors="replace") if path.suffix == ".md" else _prose_of(path)
    found = sorted({m.group(0) for m in OUTSIDE.finditer(text)})
    assert not found, f"{_where(path)} cites documents outside the repository: {found}; cite a repo file instead"


@cache
def _defined(module: str) -> set[str] | None:
    """The top-level names a module of ours defines or imports (its submodules for a package); None if no module."""
    rel = Path(*module.split(".")[1:])
    path = next((p for p in (PACKAGE / rel / "__init__.py", PACKAGE / rel.with_suffix(".py")) if p.is_file()), None)
    if path is None:
        return None
    names = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()} \
        if path.name == "__init__.py" else set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        names = _defined(".".join(parts[:i]))
        if names is not None:
            return i == len(parts) or parts[i] in names
    return parts == ["dflash_regen"]


@pytest.mark.parametrize("path", [*MARKDOWN, *SOURCES], ids=_where)
def test_no_comment_names_a_module_the_package_no_longer_has(path):
    text = path.read_text(errors="replace") if path.suffix == ".md" else _prose_of(path)
    stale = {m.group(0) for m in OLD_NAME.finditer(text)} | {m.group(0) for m in OLD_WORD_AS_MODULE.finditer(text)}
    stale -= NOT_MODULES
    stale |= {d for d in (m.group(0) for m in DOTTED.finditer(text)) if not d.endswith(".py") and not _resolves(d)}
    stale |= {r for r in (m.group(0) for m in PACKAGE_ATTR.finditer(text))
              if r not in FOREIGN and not _resolves("dflash_regen." + r)}
    assert not stale, (f"{_where(path)} names modules that do not exist (since the stage subpackages): "
                       f"{sorted(stale)}; name the new module, e.g. dflash_regen.generate.shard or generate/shard.py")
