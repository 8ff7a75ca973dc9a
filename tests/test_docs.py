"""Every fenced ```python block in docs/*.md runs here; shell commands are parsed.

Blocks of one Markdown file run in order, in one new process and one namespace (like a
notebook; forked from a server that imported JAX and jdist once), with the suite's
environment (8 virtual CPU devices, low XLA collective timeouts; set by conftest and
inherited). Tracebacks name the Markdown file and line.

A block preceded by the comment ``<!-- doctest: multiprocess nprocs=N devices=D -->`` is
a whole script for every rank of a job: it is written to a file and run with
``python -m jdist.launch --standalone --nproc-per-node N --devices-per-proc D`` (what the
docs tell users to do) and must exit 0. No other marker exists, and none skips a block.

```bash``` blocks are not executed, but every ``jdist-run`` / ``python -m jdist.launch``
and ``python -m jdist.testing.parity`` command in them is parsed with the real argument
parser, so documented flags exist. Relative links between the docs must resolve.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->\s*$")
SINGLE_TIMEOUT = 300.0  # seconds per Markdown file (generous: CI machines are shared)
MULTI_TIMEOUT = 240.0


class Block(NamedTuple):
    path: str  # relative to the repository root
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    options: dict  # from the doctest marker ({} when none)


def parse_marker(text: str, where: str) -> dict:
    """``multiprocess nprocs=2 devices=2`` -> ``{"multiprocess": True, "nprocs": 2, ...}``."""
    words = text.split()
    if not words or words[0] != "multiprocess":
        raise ValueError(f"{where}: unknown doctest marker {text!r}; the only marker is "
                         f"'multiprocess [nprocs=N] [devices=D]'")
    opts: dict = {"multiprocess": True, "nprocs": 2, "devices": 1}
    for w in words[1:]:
        key, _, value = w.partition("=")
        if key not in ("nprocs", "devices") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{where}: bad doctest option {w!r}; use nprocs=N or devices=D "
                             f"with N, D >= 1")
        opts[key] = int(value)
    return opts


def extract(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their doctest options."""
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang = m.group(1).lower()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(prev.strip())
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: code block is never closed")
        opts = parse_marker(marker.group(1), f"{rel}:{i}") if marker else {}
        if opts and lang != "python":
            raise ValueError(f"{rel}:{i}: a doctest marker precedes a {lang!r} block; "
                             f"markers apply to python blocks only")
        blocks.append(Block(rel, start + 1, lang, "\n".join(lines[start:j]) + "\n", opts))
        i = j + 1
    return blocks


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in extract(p)]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Runs the blocks of one file in order in one namespace, in the file's work directory.
# Each block is compiled with leading blank lines so that tracebacks show the Markdown
# line numbers.
_RUNNER = r"""
import json, os, sys
os.chdir(sys.argv[2])
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    print(f"--- {b['path']}:{b['line']}", flush=True)
    code = compile("\n" * (b["line"] - 1) + b["code"], b["path"], "exec")
    exec(code, ns)
"""


def _single_files() -> list[str]:
    files = []
    for p in doc_files():
        if any(b.lang == "python" and not b.options for b in extract(p)):
            files.append(str(p.relative_to(ROOT)))
    return files


def _multi_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "python" and b.options]


def _fail_text(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n" \
           f"{proc.stderr[-6000:]}"


def _run_file(rel: str, workdir: Path) -> subprocess.CompletedProcess:
    """Run the single-process python blocks of ``rel`` in one process that is new to
    them: forked from a server that imported JAX, Flax, Optax and jdist once for all
    files (what ``jdist-run --start-method forkserver`` does; nothing is initialized
    before the fork), instead of paying seconds of imports per file."""
    from jdist.launch._forkserver import forkserver_script

    blocks = [b._asdict() for b in extract(ROOT / rel) if b.lang == "python" and not b.options]
    spec, runner = workdir / "blocks.json", workdir / "run_blocks.py"
    spec.write_text(json.dumps(blocks))
    runner.write_text(_RUNNER)
    preload = os.environ.get("JDIST_FORKSERVER_PRELOAD", "jax").split(",")
    proc = forkserver_script(["script", str(runner), str(spec), str(workdir)], _env(),
                             preload)
    out: dict = {}
    readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()))
               for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for t in readers:
        t.start()
    try:
        code = proc.wait(SINGLE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session
        code = proc.wait(30)
    for t in readers:
        t.join(30)
    return subprocess.CompletedProcess(
        runner, code, out.get("stdout", b"").decode(errors="replace"),
        out.get("stderr", b"").decode(errors="replace"))


@pytest.fixture(scope="module")
def single_runs(request, tmp_path_factory):
    """All files' interpreters, two at a time (each is mostly single-threaded compiles).

    They share nothing (no collectives across processes), so running them side by side
    only changes the wall time; each test below waits for its own file's result.
    """
    from concurrent.futures import ThreadPoolExecutor

    selected = [item.callspec.params["rel"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_python_blocks_run"]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {rel: pool.submit(_run_file, rel, tmp_path_factory.mktemp("doc"))
               for rel in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("rel", _single_files())
def test_python_blocks_run(rel, single_runs):
    proc = single_runs[rel].result()
    assert proc.returncode == 0, _fail_text(proc)
    # every block started (the runner prints a header per block)
    n = sum(1 for b in extract(ROOT / rel) if b.lang == "python" and not b.options)
    assert proc.stdout.count("--- ") >= n, _fail_text(proc)


_DONE_LINE = ("\nimport os as _os\n"
              "open(_os.path.join(_os.environ['JDIST_DOC_DONE_DIR'], _os.environ['RANK']), "
              "'w').close()\n")


@pytest.mark.parametrize("block", _multi_blocks(), ids=lambda b: f"{b.path}:{b.line}")
def test_multiprocess_blocks_run(block, tmp_path):
    script = tmp_path / "doc_block.py"
    done = tmp_path / "done"
    done.mkdir()
    # the block, then a line that records that this rank reached its end
    script.write_text("\n" * (block.line - 1) + block.code + _DONE_LINE)
    n, d = block.options["nprocs"], block.options["devices"]
    cmd = [sys.executable, "-m", "jdist.launch", "--standalone", "--nproc-per-node", str(n),
           "--devices-per-proc", str(d), str(script)]
    env = _env()
    env["JDIST_DOC_DONE_DIR"] = str(done)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=MULTI_TIMEOUT)
    assert proc.returncode == 0, f"{block.path}:{block.line}\n" + _fail_text(proc)
    assert sorted(p.name for p in done.iterdir()) == [str(r) for r in range(n)], \
        _fail_text(proc)


# ----------------------------------------------------------------- static checks


def _commands(code: str) -> list[list[str]]:
    """Shell commands of a bash block (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", code)
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part)
            if words:
                out.append(words)
    return out


def _check_command(words: list[str], where: str) -> None:
    from jdist.launch._config import parse_args
    from jdist.testing.parity import parser as parity_parser

    if words[0] == "jdist-run":
        argv = words[1:]
    elif words[:3] == ["python", "-m", "jdist.launch"]:
        argv = words[3:]
    elif words[:3] == ["python", "-m", "jdist.testing.parity"]:
        try:
            parity_parser().parse_args(words[3:])
        except SystemExit as exc:
            raise AssertionError(f"{where}: bad parity command {shlex.join(words)}") from exc
        return
    else:
        return
    try:
        cfg = parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: bad launcher command {shlex.join(words)}") from exc
    assert cfg.script, where
    if cfg.script.startswith(("examples/", "benchmarks/")):  # the repository's scripts exist
        assert (ROOT / cfg.script).exists(), f"{where}: no such script {cfg.script}"


def test_shell_commands_parse():
    checked = 0
    for b in all_blocks():
        if b.lang in ("bash", "sh", "shell", "console"):
            for words in _commands(b.code):
                _check_command(words, f"{b.path}:{b.line}")
                checked += 1
    assert checked > 0


def test_every_block_has_a_runner_and_a_language():
    blocks = all_blocks()
    assert any(b.lang == "python" for b in blocks)
    for b in blocks:
        assert b.lang, f"{b.path}:{b.line}: give the code block a language (python, bash, text)"
        if b.lang == "python":
            compile(b.code, f"{b.path}:{b.line}", "exec")  # syntax, before running anything
        elif b.lang not in ("bash", "sh", "shell", "console", "text"):
            raise AssertionError(f"{b.path}:{b.line}: unexpected block language {b.lang!r}")


def test_relative_links_resolve():
    for p in doc_files():
        text = p.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (p.parent / target).exists(), f"{p.name}: broken link {target!r}"


def test_extractor_markers(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n\n<!-- doctest: multiprocess nprocs=3 devices=2 -->\n```python\n"
                  "a = 1\n```\n\n```bash\njdist-run x.py\n```\n```python\nb = 2\n```\n")
    blocks = extract(md)
    assert [(b.lang, b.line, b.options.get("nprocs")) for b in blocks] == [
        ("python", 5, 3), ("bash", 9, None), ("python", 12, None)]
    assert blocks[0].options["devices"] == 2 and blocks[2].options == {}
    md.write_text("<!-- doctest: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="unknown doctest marker 'skip'"):
        extract(md)
    md.write_text("<!-- doctest: multiprocess nprocs=0 -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="bad doctest option 'nprocs=0'"):
        extract(md)
    md.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        extract(md)
    assert _commands("jdist-run --nnodes 2 \\\n  --node-rank 1 t.py  # c\n# only\n") == [
        ["jdist-run", "--nnodes", "2", "--node-rank", "1", "t.py"]]
    with pytest.raises(AssertionError, match="bad launcher command"):
        _check_command(["jdist-run", "--no-such-flag", "t.py"], "here")
