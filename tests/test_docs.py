"""The docs: docs/configuration.md is what the schema generates, it shows every key of every model
family with its valid values, the links between the README and the pages resolve, and the Python
API's examples call it as it is."""

import ast
import inspect
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


def test_the_python_examples_call_the_api_as_it_is():
    """The README's and docs/api.md's Python blocks (notebooks/quickstart.ipynb runs the same calls,
    tests/test_notebook.py): each `api.f(...)`, `run.m(...)` and `plan.m(...)` binds to a signature
    of podtrain.api, each attribute read of a run or plan exists, and every function is shown."""
    from podtrain import api
    from podtrain.planning.plan import Plan

    owners = {"api": [api], "run": [api.Run], "plan": [api.Plan, Plan]}  # api.Plan reads Plan's attributes
    blocks = [block for page in (ROOT / "README.md", ROOT / "docs" / "api.md") for block in python_blocks(page)]
    used = set()
    for node in ast.walk(ast.parse("\n".join(blocks))):
        target = node.func if isinstance(node, ast.Call) else node
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
            continue
        if (name := target.value.id) not in owners:
            continue
        found = [
            o for o in owners[name] if hasattr(o, target.attr) or target.attr in getattr(o, "__dataclass_fields__", {})
        ]
        assert found, f"{name}.{target.attr} is not in podtrain.api"
        used.add(f"{name}.{target.attr}")
        if node is not target:  # a call: its arguments bind (a method's self among them)
            args = [None] * (len(node.args) + (name != "api"))
            inspect.signature(getattr(found[0], target.attr)).bind(*args, **{k.arg: None for k in node.keywords})
    functions = {f"api.{n}" for n in api.__all__ if inspect.isfunction(getattr(api, n))}
    assert functions <= used and "run.generate" in used, functions - used


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
