"""Repositories for SWE tasks, rebuilt from PyPI alone, byte for byte.

The generated tasks' repositories are not stored anywhere: each is a pinned sdist from PyPI (name,
version, sha256 in LIBRARIES), unpacked and committed with a fixed author, committer, date and
message, so its commit hash is the same on every machine. Each task's buggy state is one more such
commit on top (the task's `patch` applied in reverse), so the row's `base_commit` is checked when
the repository is rebuilt.

    python -m resources_servers.swe.repos --tasks resources_servers/swe/data/generated/*.jsonl \
        --into .cache/swe/repos

`--into` then holds `pypi__<library>/`, a git repository per library with a tag `task/<instance_id>`
per task; the environment's `repos_dir` points there. The libraries are data: `data/libraries.jsonl`
(or `--libraries FILE`), one JSON object a line: `name`, `version`, `sha256` (of the sdist), `modules`
(the files bugs go into), `pythonpath` (default `.`). Downloads go through `pip download` (the only
network access) into a cache folder, checked against the pinned sha256.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

FOLDER = Path(__file__).resolve().parent
# Build outputs, outside the server folder (and ignored by git): .cache/swe/ at the repository root.
DEFAULT_CACHE = FOLDER.parents[1] / ".cache" / "swe" / "sdists"
DEFAULT_REPOS = FOLDER.parents[1] / ".cache" / "swe" / "repos"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "rollgym", "GIT_AUTHOR_EMAIL": "tasks@rollgym.invalid", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "rollgym", "GIT_COMMITTER_EMAIL": "tasks@rollgym.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent",
}
GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n"
# Run in the repository's root inside the sandbox; node ids are appended. Plugins of the toolchain's
# environment stay off, and a repository's own addopts (coverage flags) are dropped.
TEST_CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider -o addopts= -q"


@dataclass(frozen=True)
class Library:
    name: str  # the PyPI name
    version: str
    sha256: str
    modules: tuple[str, ...]  # the files bugs are injected into (relative to the sdist root)
    pythonpath: str = "."  # where its package is imported from

    @property
    def repo(self) -> str:
        return f"pypi/{self.name}"

    @property
    def test_cmd(self) -> str:
        return f"PYTHONPATH={self.pythonpath} {TEST_CMD}"


LIBRARIES_FILE = FOLDER / "data" / "libraries.jsonl"


class RepoError(Exception):
    pass


def load_libraries(path: Path | str = LIBRARIES_FILE) -> dict[str, Library]:
    """The libraries tasks are generated from: one JSON object a line (name, version, sha256, modules,
    pythonpath?); an error names the line and the key."""
    libraries: dict[str, Library] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise RepoError(f"{where}: not JSON ({exc})") from None
        if not isinstance(entry, dict):
            raise RepoError(f"{where}: must be a JSON object")
        for key, kind in (("name", str), ("version", str), ("sha256", str), ("modules", list)):
            if not isinstance(entry.get(key), kind) or not entry[key]:
                raise RepoError(f"{where}: key {key!r} is required ({kind.__name__})")
        unknown = set(entry) - {"name", "version", "sha256", "modules", "pythonpath"}
        if unknown:
            raise RepoError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        if len(entry["sha256"]) != 64:
            raise RepoError(f"{where}: key 'sha256' must be the sdist's 64 hex digits")
        libraries[entry["name"]] = Library(entry["name"], entry["version"], entry["sha256"], tuple(entry["modules"]),
                                           entry.get("pythonpath", "."))
    return libraries


LIBRARIES = load_libraries()


def repo_dir_name(repo: str) -> str:
    """SWE-bench's convention: "owner/name" lives in `owner__name`."""
    return repo.replace("/", "__")


def git(cwd: Path | str, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **GIT_IDENTITY, **(env or {})})
    if done.returncode != 0:
        raise RepoError(f"git {' '.join(args[:3])} failed in {cwd}: {done.stderr.strip()[-500:]}")
    return done.stdout


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def sdist(lib: Library, cache: Path = DEFAULT_CACHE) -> Path:
    """The library's pinned sdist: from the cache, else downloaded with pip; its sha256 checked."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = _normal(f"{lib.name}-{lib.version}.tar.gz")
    found = [p for p in cache.glob("*.tar.gz") if _normal(p.name) == wanted]
    if not found:
        # The sdist of the library alone: its build backend (pip reads the sdist's metadata with it) may come
        # as a wheel, not built from source too (`:all:` builds setuptools, hatchling, ... first).
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", lib.name,
                               "--dest", str(cache), "-q", f"{lib.name}=={lib.version}"], capture_output=True, text=True)
        found = [p for p in cache.glob("*.tar.gz") if _normal(p.name) == wanted]
        if done.returncode != 0 or not found:
            raise RepoError(f"pip download {lib.name}=={lib.version} failed: {done.stderr.strip()[-500:]}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != lib.sha256:
        raise RepoError(f"{found[0]} has sha256 {digest}, not the pinned {lib.sha256}")
    return found[0]


def clean_repo(lib: Library, into: Path, cache: Path = DEFAULT_CACHE) -> tuple[Path, str]:
    """`into/pypi__<name>`: the sdist committed once (reused when already there); returns it and the commit."""
    target = into / repo_dir_name(lib.repo)
    if (target / ".git").is_dir():
        return target, git(target, "rev-list", "--max-parents=0", "HEAD").split()[0]
    archive = sdist(lib, cache)
    staging = Path(tempfile.mkdtemp(prefix="rollgym-sdist-", dir=into if into.exists() else None))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        (root,) = list(staging.iterdir())
        (root / ".gitignore").write_text(GITIGNORE)
        git(root, "init", "-q", "-b", "main")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"{lib.name} {lib.version} from its PyPI sdist")
        into.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, git(target, "rev-parse", "HEAD").strip()


def commit_task(repo: Path, clean: str, instance_id: str, patch: str, tag: bool = True) -> str:
    """The task's buggy state: the clean commit with the fix (`patch`) reversed, as a fixed commit (tagged
    `task/<instance_id>` unless `tag` is False). Made in an index of its own: the work tree is not touched."""
    index = Path(tempfile.mkdtemp(prefix="rollgym-index-")) / "index"
    try:
        env = {"GIT_INDEX_FILE": str(index)}
        git(repo, "read-tree", clean, env=env)
        git(repo, "apply", "--cached", "-R", "-", stdin=patch, env=env)
        tree = git(repo, "write-tree", env=env).strip()
    finally:
        shutil.rmtree(index.parent, ignore_errors=True)
    commit = git(repo, "commit-tree", tree, "-p", clean, "-m", instance_id).strip()
    if tag:
        git(repo, "tag", "-f", f"task/{instance_id}", commit)
    return commit


def _build_library(lib: Library, rows: list[dict[str, Any]], into: Path, cache: Path) -> dict[str, str]:
    """One library's repository and its tasks' commits (tags made in one go at the end)."""
    repo, root = clean_repo(lib, into, cache)
    existing = dict(line.split(" ", 1)[::-1] for line in
                    git(repo, "for-each-ref", "--format=%(objectname) %(refname)", "refs/tags/task/").splitlines())
    made: dict[str, str] = {}
    updates = []
    for row in rows:
        ref = f"refs/tags/task/{row['instance_id']}"
        commit = existing.get(ref) or commit_task(repo, root, row["instance_id"], row["patch"], tag=False)
        if commit != row["base_commit"]:
            raise RepoError(f"{row['instance_id']}: rebuilt as {commit}, the row says {row['base_commit']}")
        if ref not in existing:
            updates.append(f"update {ref} {commit}\n")
        made[row["instance_id"]] = commit
    if updates:
        git(repo, "update-ref", "--stdin", stdin="".join(updates))
    return made


def build(rows: Iterable[dict[str, Any]], into: Path = DEFAULT_REPOS, cache: Path = DEFAULT_CACHE,
          libraries: dict[str, Library] | None = None, workers: int = 4) -> dict[str, str]:
    """Rebuild the repositories of generated task rows; every base_commit must come out the same. The
    libraries are downloaded (when not cached) and built side by side, `workers` at a time."""
    libraries = LIBRARIES if libraries is None else libraries
    rows = list(rows)
    by_library: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = row["repo"].removeprefix("pypi/")
        if name not in libraries:
            raise RepoError(f"{row['instance_id']}: repo {row['repo']!r} is not a library of the libraries file")
        by_library.setdefault(name, []).append(row)
    into.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(by_library)))) as pool:
        futures = [pool.submit(_build_library, libraries[name], group, into, cache) for name, group in by_library.items()]
        for future in futures:
            made.update(future.result())  # the first library's error, in the file's order
    return {row["instance_id"]: made[row["instance_id"]] for row in rows}


def read_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", required=True, help="generated task files (JSONL)")
    parser.add_argument("--into", default=str(DEFAULT_REPOS), help="where the repositories go")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the sdists are kept")
    parser.add_argument("--libraries", default=str(LIBRARIES_FILE), help="the libraries file (JSONL)")
    args = parser.parse_args(argv)
    try:
        made = build(read_rows(args.tasks), Path(args.into), Path(args.cache), load_libraries(args.libraries))
    except (RepoError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(made)} task commits in {args.into}, each as its row says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
