"""The documentation: the site builds in strict mode, its configuration reference lists every key of
CampaignConfig, and README.md stays a short front door whose links lead to pages that exist.

The site is built once for the module (`mkdocs build --strict` in a subprocess, as `make docs`
does): a broken link or anchor, a page missing from the nav (mkdocs.yml's `validation`) or a hook
that fails is a failure here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from html import unescape
from pathlib import Path

import pytest
from pydantic import BaseModel

from flows.config import CampaignConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.xdist_group("docs")  # one build per worker, not one per test


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "NO_MKDOCS_2_WARNING": "1",  # Material's end-of-life banner
    }
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _section_class(annotation: typing.Any) -> type | None:
    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        if isinstance(candidate, type) and (
            issubclass(candidate, BaseModel) or dataclasses.is_dataclass(candidate)
        ):
            return candidate
    return None


def _field_names(cls: type) -> dict[str, typing.Any]:
    if issubclass(cls, BaseModel):
        return {name: info.annotation for name, info in cls.model_fields.items()}
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def config_sections(
    cls: type = CampaignConfig, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], list[str]]:
    """Every section of CampaignConfig (() is the top level) and its keys, walked here independently
    of the docs hook, so a key the hook missed is caught."""
    sections = {path: []}
    for name, annotation in _field_names(cls).items():
        sections[path].append(name)
        inner = _section_class(annotation)
        if inner is not None and typing.get_origin(annotation) not in (list, dict, tuple):
            sections.update(config_sections(inner, (*path, name)))
    return sections


def _text(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", "", html))


def test_the_site_builds_without_fetching_anything(site: Path) -> None:
    index = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in index and "fonts.gstatic.com" not in index
    assert (site / "assets" / "ui.png").read_bytes() == (ROOT / "bench" / "results" / "ui.png").read_bytes()
    for page in ("getting-started", "campaigns", "benchmarks", "experiments", "reference/configuration"):
        assert (site / page / "index.html").is_file(), page


def test_configuration_reference_lists_every_section_and_key(site: Path) -> None:
    html = (site / "reference" / "configuration" / "index.html").read_text()
    sections = config_sections()
    assert ("dispatch", "harness", "limits") in sections  # a dataclass nested in a dataclass
    assert ("trainer", "loss") in sections  # a pydantic model nested in one
    anchors = {path: "-".join(path) or "top-level" for path in sections}
    starts = {}
    for path, anchor in anchors.items():
        match = re.search(rf'<h2 id="{re.escape(anchor)}"', html)
        assert match, f"no section [{'.'.join(path)}] on the configuration page"
        starts[path] = match.start()
    ordered = sorted(starts.values())
    for path, keys in sections.items():
        start = starts[path]
        following = [pos for pos in ordered if pos > start]
        body = html[start : following[0] if following else len(html)]
        for key in keys:
            assert f"<td><code>{key}</code></td>" in body, f"key {key!r} missing from [{'.'.join(path)}]"


def test_configuration_reference_shows_defaults_and_descriptions(site: Path) -> None:
    text = _text((site / "reference" / "configuration" / "index.html").read_text())
    store = CampaignConfig.model_fields["store"].annotation
    data_root = store.model_fields["data_root"]
    assert data_root.description in text
    assert f'"{data_root.default}"' in text
    # a dataclass field documented by the docstring under it, not by description=
    assert "Executions per problem (one GRPO group)." in text


def test_readme_is_a_short_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for needed in ("make run", "make test", "](bench/results/ui.png)"):
        assert needed in text, needed


def test_readme_links_lead_to_pages_and_anchors_that_exist(site: Path) -> None:
    links = re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text())
    assert len(links) >= 10
    for link in links:
        target, _, anchor = link.partition("#")
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
        if anchor and target.endswith(".md"):
            page = Path(target).relative_to("docs").with_suffix("")
            built = site / ("" if page.name == "index" else page) / "index.html"
            assert f'id="{anchor}"' in built.read_text(), f"README links to {link}: no such anchor"
