"""The docs: docs/configuration.md is what the schema generates, it shows every key of every model
family with its valid values, and the links between the README and the pages resolve."""

import re
from pathlib import Path

from podtrain.config.keys import leaves
from podtrain.config.schema import Config
from podtrain.models import MODELS
from podtrain.program.tasks.registry import train_config
from podtrain.tools.config_docs import configuration_page

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_configuration_page_is_current():
    assert PAGE.read_text() == configuration_page(), "docs/configuration.md is stale: run `make docs`"


def documented() -> dict[str, set[str]]:
    """key -> the valid-values cells of its rows in docs/configuration.md (a key may have a row per family)."""
    found: dict[str, set[str]] = {}
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 5 and (m := re.fullmatch(r"`([\w.]+)`", cells[0])):
            found.setdefault(m[1], set()).add(cells[3])
    return found


def test_every_key_of_every_family_is_documented_with_its_range():
    rows = documented()
    for name, family in MODELS.items():
        for key, f, _ in leaves(Config(model=family.config(), train=train_config(family)())):
            assert key in rows, (name, key)
            if "range" in f.metadata:
                assert str(f.metadata["range"]) in rows[key], (name, key, rows[key])
    assert rows["train.lr"] == {"> 0"} and rows["model.name"] == {", ".join(f"`{name}`" for name in MODELS)}


def test_the_models_page_describes_every_family():
    described = re.findall(r"\*\*`(\w+)`\*\*", (ROOT / "docs" / "models.md").read_text())
    assert set(described) == set(MODELS), "docs/models.md: a **`name`** paragraph per registered family"


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lines in code blocks are not headings)."""
    found, code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and (m := re.match(r"#+ (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return found


def test_links_between_pages_resolve():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in anchors(resolved), f"{page.name}: {target}"
