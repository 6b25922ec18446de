"""The README and docs/ stay true: the first two commands, the Python example, a config reference that lists
every key, and links that lead somewhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.config import Config, _to_plain
from tests.conftest import REPO


def config_keys(obj: object, prefix: str = "") -> dict[str, object]:
    keys = {}
    for f in dataclasses.fields(obj):
        name = f.name.removesuffix("_")
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys.update(config_keys(value, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = _to_plain(value)
    return keys


def test_the_config_reference_lists_every_key_with_its_default() -> None:
    reference = (REPO / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", reference, flags=re.MULTILINE))
    for key, default in config_keys(Config()).items():
        assert key in rows, f"docs/configuration.md misses {key}"
        expected = (
            '""' if default == "" else str(default).lower() if isinstance(default, bool) else str(default)
        )
        assert rows[key] == expected, (
            f"docs/configuration.md says {key} defaults to {rows[key]}, the code says {expected}"
        )


def test_readme_starts_with_the_run_and_test_commands_that_ci_uses() -> None:
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make run", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    outside_code = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", outside_code, flags=re.MULTILINE)}


def test_every_link_of_the_readme_and_docs_reaches_a_file_or_heading_of_the_repository() -> None:
    """Links in code blocks and HTML comments (rows waiting for a page, say) are not rendered: not checked."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```|<!--.*?-->", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue  # the web: not checked offline
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_python_api_example_runs(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The notebook example of the quick start, as written, on a short run (4 steps, shared cache)."""
    from elastic_qa import api

    quick_start = (REPO / "README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```python\n(.*?)```", quick_start, flags=re.DOTALL)
    as_written = api.build_config
    short = {"train.max_steps": 4, "data.cache_dir": str(cache_dir), "log.console": "none"}

    def shortened(*args: Any, **kwargs: Any) -> Config:
        return as_written(as_written(*args, **kwargs), short)

    monkeypatch.setattr(api, "build_config", shortened)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})  # the README's own code
    printed = capsys.readouterr().out.splitlines()
    checkpoint = tmp_path / "runs" / "notebook" / "checkpoints" / "step-00000004"
    assert printed[-2].startswith("4 ") and printed[-2].endswith(str(checkpoint))
    assert checkpoint.is_dir()
